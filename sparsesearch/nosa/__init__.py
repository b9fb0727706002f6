"""NOSA (paper 004): block selection with a query-aware share k_q and a query-agnostic rest, the locality
bound, training-free query-agnostic proxies, the k_q/k sweep and the offloaded decode engine.

This package is the method (make_config, the teacher-forced simulation, the sweep, the throughput model);
what decode runs — the configuration, proxies, selection, the sync-free decoder and the engine — lives in
the runtime (sparsesearch/runtime/nosa_*.py), whose public names below are re-exported here.

Public API::

    make_config(budget, kq_ratio, block, proxy) -> NosaConfig           # validated; budget in tokens
    select_blocks(sq, se, tail, k=, k_q=, n_init=, n_win=) -> (selected, query_aware)   # Eq. 5, exact ties
    simulate_layer(LayerInputs, cfg) -> (sparse output, metrics)          # one layer, all decode steps
    run_sweep(SweepSettings) -> SweepOutcome                              # sparsesearch sweep-nosa
"""

from ..runtime.nosa_config import NosaConfig
from ..runtime.nosa_proxies import PROXIES, TRAINING_FREE
from ..runtime.nosa_selection import select_blocks
from .config import make_config
from .simulate import LayerInputs, simulate_layer

__all__ = ["PROXIES", "TRAINING_FREE", "LayerInputs", "NosaConfig", "make_config", "select_blocks", "simulate_layer"]
