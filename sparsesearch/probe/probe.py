"""TriangleMix gradient probing (paper 002 §2.3) and the choice of the triangle start layer.

Per sample: a key-value retrieval prompt (paper 002 App. A.1) followed by the tokens of the answer that
come before its first content token; y_gt is the logit of that first content token. One forward with
autograd through a registered attention function keeps each layer's post-RoPE Q, K, V and a hook on its
attention output collects dO = ∂y/∂O. With θ = 1 multiplying the probabilities, ∂y/∂θ_ij = P_ij (dO_i·V_j),
so each layer's section sums (Streaming, Middle, Last) are reduced blockwise from Q, K, V, dO and the
lse — O(N) memory, no θ tensor and no n x n matrix (probe.sections over kernels.section_grad).

Recorded per (layer, head, section), as mean and standard error over samples: the signed Grad (the
paper's quantity), mean |∂y/∂θ|, and Att (mean probability). On small models the signed Middle Grad flips
sign between layers and sits near zero (docs/peers.md), so the start-layer rule uses the stable quantity:
the Middle section's mean |∂y/∂θ| summed over heads (see ``choose_start_layer``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

SECTIONS = ("stream", "middle", "last")


@dataclass(frozen=True)
class ProbeSettings:
    samples: int = 100
    tokens: int = 2048
    sink: int = 64
    window: int = 128
    last: int = 128
    seed: int = 0
    data: str = "synthetic:kv-retrieval"

    def check(self, max_positions: int | None) -> None:
        if self.samples < 1:
            raise ValueError(f"--samples must be >= 1, got {self.samples}")
        if self.tokens < 64:
            raise ValueError(f"--tokens must be >= 64, got {self.tokens}")
        if max_positions is not None and self.tokens > max_positions:
            raise ValueError(f"--tokens {self.tokens} exceeds the model's context of {max_positions} tokens")
        if self.last >= self.tokens:
            raise ValueError(f"--last must be smaller than --tokens ({self.tokens}), got {self.last}")
        if self.sink < 0 or self.window < 1 or self.last < 1:
            raise ValueError(f"need --sink >= 0, --window >= 1, --last >= 1; got {self.sink}, {self.window}, {self.last}")


@dataclass
class ProbeResult:
    """Per (layer, head, section) statistics over samples, float64 [L, H, 3] each."""

    grad_mean: torch.Tensor
    grad_se: torch.Tensor
    abs_mean: torch.Tensor
    abs_se: torch.Tensor
    att_mean: torch.Tensor
    att_se: torch.Tensor
    samples: int
    tokens: list[int] = field(default_factory=list)

    def layer_curve(self, quantity: str = "abs", section: str = "middle") -> torch.Tensor:
        """Per-layer value summed over heads (the paper sums heads): float64 [L]."""
        table = {"abs": self.abs_mean, "grad": self.grad_mean, "att": self.att_mean}[quantity]
        return table[:, :, SECTIONS.index(section)].sum(dim=1)


def probe_input(sample) -> tuple[torch.Tensor, int]:
    """ids [N'] = prompt + the answer tokens before its first content token, and the y_gt token id."""
    answer = sample.answer_ids
    if answer is None or answer.numel() == 0:
        raise ValueError("the tokenizer gives no answer tokens for this sample: no first token to probe")
    start = int(sample.meta.get("answer_content_index", 0))
    if start >= answer.numel():
        raise ValueError("the tokenizer splits the value so that no first content token exists")
    return torch.cat([sample.input_ids, answer[:start]]), int(answer[start])


def probe_sample(model, ids: torch.Tensor, target: int, spec, *, device, skip: tuple[int, ...] = ()) -> dict[str, torch.Tensor]:
    """One sample: section sums per layer. Returns grad/abs/att means, float64 [L, H, 3].

    skip: layers left unprobed, NaN in the result — a hybrid model's sliding-window layers, whose
    probabilities are not the causal softmax the section sums assume (and which TriangleMix never touches)."""
    from ..models.capture import attention_capture, attention_lse
    from .sections import section_sums_auto

    layers: dict[int, dict] = {}

    def sink(module, query, key, value, attention_mask, output, scaling) -> None:
        # Under gradient checkpointing a layer's attention runs twice (forward, then recompute in backward):
        # keep the first entry and hook only once, so the gradient lands where the tensors are.
        if module.layer_idx in skip:
            return
        entry = layers.setdefault(module.layer_idx, {"q": query.detach(), "k": key.detach(), "v": value.detach(), "scale": scaling})

        def keep(grad, entry=entry):
            entry["do"] = grad.detach()

        if output.requires_grad and not entry.get("hooked"):
            output.register_hook(keep)
            entry["hooked"] = True

    embed = model.get_input_embeddings()
    inputs = embed(ids[None].to(device)).detach().requires_grad_(True)
    with torch.enable_grad(), attention_capture(model, sink):
        logits = model(inputs_embeds=inputs, use_cache=False, logits_to_keep=1).logits
        y = logits[0, -1, target].float()
        y.backward()
    grad, absg, att = [], [], []
    num_layers = int(model.config.get_text_config().num_hidden_layers)
    for layer in range(num_layers):
        if layer in skip:
            grad.append(None), absg.append(None), att.append(None)
            continue
        e = layers.pop(layer)
        do = e["do"]
        if do.shape != e["q"].shape:  # transformers hands back [B, N, H, D]; sections want [B, H, N, D]
            do = do.transpose(1, 2)
        with torch.no_grad():
            lse = attention_lse(e["q"], e["k"], scale=e["scale"])
            sums = section_sums_auto(e["q"], e["k"], e["v"], do.to(e["q"].dtype), lse, spec, scale=e["scale"])
        count = sums.count.double().clamp_min(1)[None, :]
        grad.append((sums.grad_sum[0] / count))
        absg.append((sums.abs_grad_sum[0] / count))
        att.append((sums.prob_sum[0] / count))
    model.zero_grad(set_to_none=True)
    return {"grad": _stack_layers(grad), "abs": _stack_layers(absg), "att": _stack_layers(att)}


def _stack_layers(per_layer: list[torch.Tensor | None]) -> torch.Tensor:
    """[L, H, 3] on CPU from per-layer [H, 3] tensors; a skipped layer (None) is NaN."""
    like = next(t for t in per_layer if t is not None)
    return torch.stack([t if t is not None else torch.full_like(like, float("nan")) for t in per_layer]).cpu()


def aggregate(per_sample: list[dict[str, torch.Tensor]], tokens: list[int]) -> ProbeResult:
    """Mean and standard error over samples (se = std / sqrt(n); 0 for one sample)."""
    n = len(per_sample)

    def stats(name):
        stack = torch.stack([s[name] for s in per_sample])
        se = stack.std(dim=0, unbiased=True) / math.sqrt(n) if n > 1 else torch.zeros_like(stack[0])
        return stack.mean(dim=0), se

    g, gs = stats("grad")
    a, as_ = stats("abs")
    t, ts = stats("att")
    return ProbeResult(g, gs, a, as_, t, ts, n, tokens)


@dataclass(frozen=True)
class StartRule:
    """First layer L such that every layer l >= L has Middle mean |∂y/∂θ| (summed over heads) at most
    `threshold` x the peak over all layers. |∂y/∂θ| is used because the signed mean is unstable on small
    models (near zero, sign flips); the rule and its threshold are recorded in the artifact."""

    threshold: float = 0.2
    quantity: str = "middle_abs_grad_sum_over_heads"

    def choose(self, result: ProbeResult) -> int:
        """The start layer. Unprobed layers (NaN: a hybrid model's sliding layers) neither count for the
        peak nor break the run, and the start is a probed layer — triangle applies to those only."""
        curve = result.layer_curve("abs", "middle")
        probed = ~torch.isnan(curve)
        if not bool(probed.any()):
            return len(curve)
        peak = float(curve[probed].max())
        if peak <= 0:
            return int(probed.nonzero()[0])
        below = curve <= self.threshold * peak
        start = len(curve)
        for layer in range(len(curve) - 1, -1, -1):
            if not bool(probed[layer]):
                continue
            if not bool(below[layer]):
                break
            start = layer
        return start

    def describe(self) -> str:
        return f"first layer after which middle-section mean |dy/dtheta| (sum over heads) stays <= {self.threshold} x its peak"
