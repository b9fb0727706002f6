"""NOSA configurations: budget in tokens -> blocks, sink/window defaults, and the checks of bad input.

Units: ``budget`` is in tokens (the CLI's --budget); ``k = budget // block`` blocks, the GPU slots per
(layer, sequence, KV head) besides the tail block. ``kq_ratio`` is k_q / k, rounded down to whole blocks.
Sink and window follow NOSI (1 sink block, 16 window blocks = 1024 tokens at block 64): n_init = 1 block,
n_win = 1024 tokens of window as blocks (8 at block 128, 32 at block 32), capped at a quarter of k so small
budgets keep room for selection, and at least 1 (the locality bound needs the window to cover the last
compressed unit of a candidate block: block * n_win >= kernel - stride).
"""

from __future__ import annotations

from ..runtime.nosa_config import STRIDE, NosaConfig
from ..runtime.nosa_proxies import check_proxy

WINDOW_TOKENS = 1024  # NOSI: 16 blocks of 64
N_INIT = 1


def default_window(block: int, k: int) -> int:
    """n_win in blocks: 1024 tokens of window, at most a quarter of k, at least 1."""
    return max(1, min(WINDOW_TOKENS // block, k // 4))


def check_block(block: int, stride: int = STRIDE) -> None:
    if block <= 0 or block % stride:
        raise ValueError(f"--block-size {block} is not a positive multiple of the pooling stride {stride}")


def make_config(budget: int, kq_ratio: float, block: int, proxy: str, *, n_init: int = N_INIT, n_win: int | None = None) -> NosaConfig:
    """A validated configuration (ValueError naming the bad value otherwise)."""
    check_block(block)
    check_proxy(proxy)
    if budget <= 0 or budget % block:
        raise ValueError(f"--budget {budget} is not a positive multiple of the block size {block}")
    if not 0 <= kq_ratio <= 1:
        raise ValueError(f"--kq-ratio {kq_ratio} is outside [0, 1] (k_q > k)")
    k = budget // block
    n_win = default_window(block, k) if n_win is None else n_win
    if k < n_init + n_win + 1:
        raise ValueError(
            f"--budget {budget} ({k} blocks of {block}) is below sink + window + 1 = {n_init} + {n_win} + 1 blocks "
            f"({(n_init + n_win + 1) * block} tokens)"
        )
    k_q = int(kq_ratio * k)
    if k_q > k - n_init - n_win:
        raise ValueError(
            f"--kq-ratio {kq_ratio} gives k_q = {k_q} blocks > k - sink - window = {k - n_init - n_win} at budget {budget}"
        )
    return NosaConfig(block=block, k=k, k_q=k_q, n_init=n_init, n_win=n_win, proxy=proxy)
