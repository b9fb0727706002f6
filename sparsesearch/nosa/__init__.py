"""NOSA (paper 004): block selection with a query-aware share k_q and a query-agnostic rest, the locality
bound, training-free query-agnostic proxies, the k_q/k sweep and the offloaded decode engine.

Public API::

    make_config(budget, kq_ratio, block, proxy) -> NosaConfig           # validated; budget in tokens
    select_blocks(sq, se, tail, k=, k_q=, n_init=, n_win=) -> (selected, query_aware)   # Eq. 5, exact ties
    simulate_layer(LayerInputs, cfg) -> (sparse output, metrics)          # one layer, all decode steps
    run_sweep(SweepSettings) -> SweepOutcome                              # sparsesearch sweep-nosa
"""

from .config import NosaConfig, make_config
from .proxies import PROXIES, TRAINING_FREE
from .selection import select_blocks
from .simulate import LayerInputs, simulate_layer

__all__ = ["PROXIES", "TRAINING_FREE", "LayerInputs", "NosaConfig", "make_config", "select_blocks", "simulate_layer"]
