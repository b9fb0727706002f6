"""The NOSA configuration the runtime decodes with: blocks of ``block`` tokens, k slots per (layer, sequence,
KV head) besides the tail block, k = n_init sink + n_win window + k_q query-aware + k_e query-agnostic
blocks, compressed keys pooled over ``kernel`` keys at ``stride``. Built by ``nosa.config.make_config``
(the sweep, from the CLI's budget) or read off an artifact (``runtime.nosa_engine.config_from_artifact``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

KERNEL = 32  # compressed-key mean pool (InfLLM-v2 / NOSA code)
STRIDE = 16


@dataclass(frozen=True)
class NosaConfig:
    """One point of the sweep. Blocks: k = n_init + n_win + k_q + k_e."""

    block: int
    k: int
    k_q: int
    n_init: int
    n_win: int
    proxy: str
    kernel: int = KERNEL
    stride: int = STRIDE

    @property
    def k_e(self) -> int:
        return self.k - self.n_init - self.n_win - self.k_q

    @property
    def budget(self) -> int:
        return self.k * self.block

    @property
    def ratio(self) -> int:
        return self.block // self.stride

    @property
    def bound(self) -> float:
        """The locality bound gamma >= (k - k_q) / k at stable steps (sink and window counted)."""
        return (self.k - self.k_q) / self.k

    @property
    def name(self) -> str:
        return f"{self.proxy}-b{self.block}-k{self.k}-kq{self.k_q}"

    def to_dict(self) -> dict:
        return asdict(self) | {"k_e": self.k_e, "budget": self.budget}
