"""The persistent warp-specialized Hopper kernel (kernels/block_sparse_ws.py).

CPU: which launches it takes, and that it compiles for sm_90 with the installed Triton (Gluon has no
interpreter; the compile runs the whole pipeline down to SASS, no GPU needed). On a Hopper GPU: outputs against
the fp32 oracle on odd lengths, batch 2, bottom-right alignment, empty rows, d 64 and fp16, and against the
Triton kernel it replaces."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from indices import random_index
from sparsesearch.index import validate
from sparsesearch.kernels import block_sparse_attention
from sparsesearch.kernels import block_sparse_ws as ws
from sparsesearch.kernels.block_sparse import _launch_config
from sparsesearch.reference import index_mask_fn
from sparsesearch.patterns import vertical_slash
from test_kernels import assert_close, qkv, vs_lines

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _plain(batch=1, q_heads=4, kv_heads=2, n=130, dim=128, dtype=torch.bfloat16, **kw):
    q, k, v = (torch.empty(batch, h, n, dim, dtype=dtype) for h in (q_heads, kv_heads, kv_heads))
    index = random_index(batch, kv_heads, n, n, 64, 64, head_space="kv", **kw)
    return q, k, v, index


def test_shapes_fit_the_plain_kv_space_launch_only():
    q, k, v, index = _plain()
    assert ws.ws_shapes_fit(q, k, v, index)
    assert not ws.ws_eligible(q, k, v, index), "CPU tensors never take the GPU kernel"
    assert not ws.ws_shapes_fit(*_plain(dim=96)[:3], _plain(dim=96)[3])
    assert not ws.ws_shapes_fit(*_plain(dtype=torch.float32))
    assert ws.ws_shapes_fit(*_plain(q_heads=3, kv_heads=1))  # an odd GQA group
    assert ws.ws_shapes_fit(*_plain(q_heads=14, kv_heads=2))  # Qwen2-VL-7B's group of 7
    assert ws.ws_shapes_fit(*_plain(q_heads=2, kv_heads=2))  # MHA: two query blocks per item
    assert not ws.ws_shapes_fit(*_plain(q_heads=3, kv_heads=2))
    assert not ws.ws_shapes_fit(*_plain(columns=3))
    assert ws.ws_shapes_fit(*_plain(window=50, sink=10))  # A-shape and the triangle's streaming rows
    assert not ws.ws_shapes_fit(q, k, v, dataclasses.replace(index, head_space="query"))
    assert ws.ws_shapes_fit(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, index)  # the runtime's layout
    shifted = torch.empty(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape)  # contiguous, base 2 bytes off
    assert not ws.ws_shapes_fit(shifted, k, v, index)
    ragged = torch.empty(*q.shape[:3], 129, dtype=q.dtype)[..., :128]  # a row stride of 258 bytes
    assert not ws.ws_shapes_fit(ragged, k, v, index)
    assert not ws.ws_shapes_fit(q, k.transpose(2, 3).contiguous().transpose(2, 3), v, index)  # D not unit-strided


def test_three_or_four_heads_per_item_where_more_warpgroups_win():
    """Three for groups of 3 and 9, at d 64 for groups of 6 and 12 (even ones at d 128 ran slower), for groups of 5
    (but at d 64 with a column table, not measured) and for groups of 7 at d 128 without a table and at d 64 with one.
    Four at d 64 where the items leave at most one warpgroup idle, or with a table none (groups of 12 keep three:
    equal); never at d 128, whose consumers spill in a fourth warpgroup's registers. Pairs elsewhere: groups of 2
    and 10, every other d-128 group not divisible by 3 (groups of 8 ran slower in threes).
    The producer gives up registers for three or four warpgroups; at d 128 three have their O leave through Q's
    buffers, so their ring has 4 stages."""
    groups = (2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 16)
    assert [ws._pack(group, 64, False) for group in groups] == [2, 3, 4, 3, 3, 4, 4, 3, 2, 3, 4]
    assert [ws._pack(group, 64, True) for group in groups] == [2, 3, 4, 2, 3, 3, 4, 3, 2, 3, 4]
    assert [ws._pack(group, 128, table) for group in (3, 4, 5, 6, 7, 8, 9, 16) for table in (False, True)] \
        == [3, 3, 2, 2, 3, 3, 2, 2, 3, 2, 2, 2, 3, 3, 2, 2]
    assert ws._plan(7, 128, False, None, 224) == (3, 4, ws.PACK3_REGS, ws.PACK3_PRODUCER_REGS)
    assert ws._plan(3, 128, False, None, 224) == (3, 4, ws.PACK3_REGS, ws.PACK3_PRODUCER_REGS)
    assert ws._plan(3, 64, True, None, 224) == (3, 3, ws.PACK3_REGS, ws.PACK3_PRODUCER_REGS)
    assert ws._plan(3, 128, True, None, 224) == (3, 4, ws.PACK3_REGS, ws.PACK3_PRODUCER_REGS)
    assert ws._plan(9, 128, False, 2, 224)[1] == 2  # a given ring depth is kept
    assert ws._plan(8, 64, False, None, 224) == (4, 3, ws.PACK4_REGS, ws.PACK4_PRODUCER_REGS)
    assert ws._plan(4, 64, True, None, 224) == (4, 3, ws.PACK4_REGS, ws.PACK4_PRODUCER_REGS)
    # The consumers' and the producer's registers fill what Triton launches the padded warpgroups with: 4 x 128
    # per thread for 13 warps, 5 x 96 for 17 (65536 / 640 rounded down to a multiple of 8).
    assert 3 * ws.PACK3_REGS + ws.PACK3_PRODUCER_REGS <= 4 * 128
    assert 4 * ws.PACK4_REGS + ws.PACK4_PRODUCER_REGS <= 5 * 96


def test_mha_rings_give_each_warpgroup_two_stages_or_more():
    """MHA items split the K/V ring between their two warpgroups, each holding its previous tile's stage while it
    waits for the next: an even ring of at least 4 stages, whatever was asked."""
    assert [ws._plan(1, 128, False, stages, 224)[:2] for stages in (None, 2, 3, 4)] == [(2, 4)] * 4
    assert ws._plan(1, 64, True, 5, 224)[1] == 6
    assert ws._plan(2, 128, False, 2, 224)[1] == 2  # GQA pairs share every stage: 2 is enough


def test_shapes_fit_columns_only_through_a_table():
    """Vertical-slash columns come in through the index's column table; column lists alone, or a launch that
    asks for the lists (``table=False``, the ``col_table: False`` config), keep the Triton kernel."""
    q, k, v, _ = _plain(n=200)
    index = vertical_slash.index_from_lines(vs_lines(1, 2, 200, 200, 40, 3, "kv"), block_m=64, block_n=64)
    assert index.col_table is not None and ws.ws_shapes_fit(q, k, v, index)
    assert not ws.ws_shapes_fit(q, k, v, index, table=False)
    assert not ws.ws_shapes_fit(q, k, v, dataclasses.replace(index, col_table=None))


def _compile(head_dim: int, stages: int, table: bool, window: bool, group: int = 2):
    """The kernel for sm_90 as block_sparse_ws_attention launches it (heads per item and registers included)."""
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    q = torch.empty(1, 4, 256, head_dim, dtype=torch.bfloat16)
    qd, kd = ws._head_descriptor(q), ws._head_descriptor(q[:, :2].contiguous())
    pack, stages, consumer_regs, producer_regs = ws._plan(group, head_dim, table, stages, 224)
    consts = dict(HEAD_DIM=head_dim, PACK=pack, GROUP=group, STAGES=stages, WINDOW=window, TABLE=table, USE_HEAD_MAP=table,
                  CONSUMER_REGS=consumer_regs, PRODUCER_REGS=producer_regs)
    fn = ws._block_sparse_ws_fwd
    signature = {}
    for name in fn.arg_names:
        if name in ("q_desc", "o_desc"):
            signature[name] = mangle_type(qd)
        elif name in ("k_desc", "v_desc", "kc_desc", "vc_desc"):
            signature[name] = mangle_type(kd)
        elif name in consts:
            signature[name] = "constexpr"
        else:
            signature[name] = {"LSE": "*fp32", "qk_scale": "fp32"}.get(name, "*i32" if name.isupper() else "i32")
    constants = {(fn.arg_names.index(n),): v for n, v in consts.items()}
    return triton_compile(GluonASTSource(fn, signature, constants), target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


def _compile_report(head_dim: int, stages: int, table: bool, window: bool, group: int = 2) -> None:
    """Print the compiled kernel's shared memory, the Hopper instructions its PTX holds, how many of its wgmmas read
    their A operand from registers and from shared memory (a register list or a descriptor after the accumulators),
    and its register spills (local stores/loads in the SASS that Triton's bundled ptxas made; PTX registers are
    virtual), as JSON."""
    import re

    from triton.tools.disasm import get_sass

    kernel = _compile(head_dim, stages, table, window, group)
    ptx = kernel.asm["ptx"]
    ops = ("wgmma.mma_async", "cp.async.bulk.tensor", "setmaxnreg")
    spills = len(re.findall(r"\b(?:STL|LDL)\b", get_sass(kernel.asm["cubin"])))
    a_operands = re.findall(r"wgmma\.mma_async[^{]*\{[^}]*\},\s*(\{|%rd)", ptx)
    print(json.dumps({"shared": kernel.metadata.shared, "spills": spills, "wgmma_waits": _ptxas_wgmma_notes(ptx),
                      "a_in_registers": a_operands.count("{"), "a_in_shared": a_operands.count("%rd"),
                      **{op: op in ptx for op in ops}}))


def _ptxas_wgmma_notes(ptx: str) -> list[str] | None:
    """ptxas's notes that it serialized the wgmmas (C7513) or injected waits between them (C7517/C7515...), from the
    CUDA 12.8 ptxas that Triton bundles for sm_90 up to 3.6 (the GPU hosts' version; 3.9 uses a 13.x ptxas, which
    accepts code that 12.8 serializes: a variant that did ran 30% slower on an H200). None when that ptxas is absent
    or cannot read this PTX."""
    import re
    import tempfile

    from triton import knobs

    try:
        path = knobs.nvidia.ptxas.path
    except Exception:  # no bundled legacy ptxas in this triton
        return None
    # Triton 3.9 writes PTX 9.x; 12.8 reads up to 8.7, and nothing this kernel uses is newer.
    ptx = re.sub(r"^\.version \d+\.\d+", ".version 8.7", ptx, count=1, flags=re.M)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        run = subprocess.run([path, "-arch=sm_90a", "-v", str(src), "-o", str(Path(tmp) / "k.cubin")],
                             capture_output=True, text=True, timeout=300)
    if run.returncode != 0:
        return None
    return [line for line in run.stderr.splitlines() if "wgmma" in line or "warpgroup" in line]


@pytest.mark.parametrize("head_dim,stages,table,window,group", [
    (128, 3, False, False, 2), (128, 3, True, True, 2), (64, 3, True, False, 2), (128, 4, False, True, 2),
    (128, 3, True, True, 7), (128, 3, False, True, 5),  # odd groups: a warpgroup idles through the smaller items
    (128, 3, False, False, 7), (64, 3, True, False, 7), (64, 3, False, False, 5), (128, 4, True, False, 5),
    # Groups of 3, 6 and 9: three warpgroups in 160 registers, Q from shared memory at d 128 or with a table.
    (64, 3, True, True, 3), (64, 3, False, False, 9), (64, 3, False, True, 6), (128, 3, False, False, 3),
    (128, 4, False, False, 9), (128, 4, False, True, 3), (128, 4, True, False, 3), (128, 3, True, True, 3),
    # Groups of 4, 7 and 8 at d 64: four warpgroups in 112 registers, Q from shared memory.
    (64, 3, False, False, 4), (64, 3, False, False, 7), (64, 3, False, True, 8), (64, 3, True, False, 4),
    (64, 3, True, True, 8),
    # MHA: two query blocks per item, each warpgroup on its own tiles.
    (128, 3, False, False, 1), (128, 3, True, True, 1), (64, 3, False, True, 1),
])
def test_compiles_for_hopper_within_shared_memory(head_dim, stages, table, window, group):
    # In a child without TRITON_INTERPRET: under the interpreter Gluon's library functions are not compilable.
    env = {key: val for key, val in os.environ.items() if key != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(root / "tests"), env.get("PYTHONPATH", "")])
    code = f"import test_block_sparse_ws as t; t._compile_report({head_dim}, {stages}, {table}, {window}, {group})"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["shared"] <= 232448, report  # H100/H200: 227 KiB of shared memory per block
    assert report["wgmma.mma_async"] and report["cp.async.bulk.tensor"] and report["setmaxnreg"], report
    pack = ws._pack(group, head_dim, table)
    # Bounds on local-memory instructions where Triton 3.9's ptxas (13.4) spills, so that a change which spills in
    # earnest fails here. 3.6's (12.8, the GPU hosts') spills 7 for four with a window and 5-42 for the table kernels
    # (none elsewhere), and on an H200 the table kernels built by 13.4 still ran 1.06-1.19x the pairs
    # (benchmarks/RESULTS.md, Run 26).
    if pack == 4:
        # Four consumers in 112 registers: 13-29 values kept in local memory (49-93 instructions), loaded at item
        # boundaries and, with a window mask, twice per key tile. With a table 288-421, about a dozen loads per key
        # tile.
        assert report["spills"] <= (440 if table else 100), report
    elif pack == 3 and head_dim == 128 and (table or window or group % 3):
        # Three d-128 consumers in 160 registers: with a window mask, or items that idle a warpgroup (groups of 5
        # and 7), 8-9 values (stores in the prologue, one L1 load per key tile); with a table 134-193 instructions,
        # 9 loads per key tile.
        assert report["spills"] <= (200 if table else 48), report
    elif pack == 3 and group % 3:
        # Three d-64 consumers, Q in registers, with items that idle one (groups of 5): 4 stores and 17 loads, none in
        # the tile loop.
        assert report["spills"] <= 32, report
    else:
        assert report["spills"] == 0, "a partition spills registers"
    # Q and P both reach the tensor cores from registers: with 64-key tiles, a QK reading Q from shared memory too
    # takes shared memory's whole bandwidth (3-5% slower per launch on an H200, RESULTS.md Run 19). Three warpgroups
    # have no registers for Q at d 128 or with a table, four none at all: there P alone comes from registers.
    if pack == 2 or (pack == 3 and head_dim == 64 and not table):
        assert report["a_in_registers"] > 0 and report["a_in_shared"] == 0, report
    else:
        assert report["a_in_registers"] > 0 and report["a_in_shared"] > 0, report
    assert not report["wgmma_waits"], report["wgmma_waits"]


def _triton_config(dim: int) -> dict:
    """The device's launch config without ``ws``: the Triton kernel."""
    return {key: val for key, val in _launch_config(64, 64, dim, torch.device("cuda")).items() if key != "ws"}


def _assert_same(out, lse, ref_o, ref_l) -> None:
    """out/lse equal the Triton kernel's within bf16 rounding; the same rows are empty (lse -inf)."""
    torch.testing.assert_close(out.float(), ref_o.float(), atol=2e-2, rtol=0)
    finite = torch.isfinite(ref_l)
    assert torch.equal(finite, torch.isfinite(lse))
    torch.testing.assert_close(lse[finite], ref_l[finite], atol=1e-3, rtol=0)


CASES = [
    # batch, q_heads, kv_heads, q_len, kv_len, dim, dtype
    (2, 4, 2, 200, 200, 128, torch.bfloat16),
    (1, 8, 2, 333, 333, 64, torch.float16),
    (1, 4, 1, 100, 260, 128, torch.bfloat16),  # bottom-right: queries are the last 100 of 260 keys
    (2, 2, 1, 64, 64, 128, torch.bfloat16),
    (2, 6, 2, 200, 200, 128, torch.bfloat16),  # d 128, a group of 3 (Llama-3.2-3B's): three heads per item
    (1, 7, 1, 130, 190, 64, torch.float16),  # a group of 7 (Qwen2-VL-7B's), bottom-right
    (2, 6, 2, 200, 200, 64, torch.bfloat16),  # d 64, a group of 3 (SmolLM2-135M's): three heads per item
    (1, 9, 1, 130, 190, 64, torch.float16),  # d 64, a group of 9: three items of three, bottom-right
    (1, 9, 1, 130, 190, 128, torch.bfloat16),  # d 128, a group of 9, bottom-right
    (2, 12, 2, 200, 200, 64, torch.bfloat16),  # d 64, a group of 6: two items of three
    (2, 16, 2, 200, 200, 64, torch.bfloat16),  # d 64, a group of 8 (two items of four)
    (1, 14, 2, 100, 260, 64, torch.bfloat16),  # d 64, groups of 7: an item of four, one of three, bottom-right
    (2, 2, 2, 200, 200, 128, torch.bfloat16),  # MHA: items of query blocks 3 and 2, then 1 and 0
    (1, 3, 3, 130, 190, 64, torch.float16),  # MHA, 3 query blocks: block 0 alone in the last item, bottom-right
    (1, 14, 2, 130, 190, 128, torch.bfloat16),  # d 128, groups of 7 in threes (3 + 2 + 2), bottom-right
    (2, 10, 2, 200, 200, 128, torch.bfloat16),  # d 128, groups of 5 in threes (3 + 2)
    (1, 10, 2, 130, 190, 64, torch.float16),  # d 64, groups of 5 in threes: Q in registers, one idle, bottom-right
]


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (sm_90)")
@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}_hq{}_hk{}_q{}_k{}_d{}".format(*c[:6]))
@pytest.mark.parametrize("stages", [2, 3])
def test_matches_oracle_and_the_triton_kernel(case, stages):
    batch, q_heads, kv_heads, q_len, kv_len, dim, dtype = case
    q, k, v = qkv(batch, q_heads, kv_heads, q_len, kv_len, dim, dtype)
    index = random_index(batch, kv_heads, q_len, kv_len, 64, 64, density=0.6, head_space="kv", device="cuda")
    validate(index, q_len, kv_len)
    assert ws.ws_eligible(q, k, v, index)
    out, lse = ws.block_sparse_ws_attention(q, k, v, index, scale=dim ** -0.5, stages=stages)
    assert_close(out, lse, q, k, v, index_mask_fn(index, q_len, kv_len, q_heads // kv_heads))
    _assert_same(out, lse, *block_sparse_attention(q, k, v, index, config=_triton_config(dim)))


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (sm_90)")
# Groups of 3 with a window mask: three warpgroups per item (_pack), Q in registers at d 64 and in shared memory at d 128;
# groups of 4 and 7 at d 64: four; groups of 7 at d 128: three, idle in two-head items; MHA.
@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[2], CASES[4], CASES[6], CASES[11], CASES[12], CASES[13],
                                  CASES[14]],
                         ids=lambda c: "b{}_hq{}_hk{}_q{}_k{}_d{}".format(*c[:6]))
@pytest.mark.parametrize("window, sink", [(70, 0), (100, 20)])
def test_window_and_sink_match_oracle_and_the_triton_kernel(case, window, sink):
    """A-shape / triangle streaming indexes: every listed block is partial and masked by the window/sink rule in
    bottom-right positions."""
    batch, q_heads, kv_heads, q_len, kv_len, dim, dtype = case
    q, k, v = qkv(batch, q_heads, kv_heads, q_len, kv_len, dim, dtype)
    index = random_index(batch, kv_heads, q_len, kv_len, 64, 64, density=0.7, window=window, sink=sink, head_space="kv", device="cuda")
    validate(index, q_len, kv_len)
    assert ws.ws_eligible(q, k, v, index)
    out, lse = ws.block_sparse_ws_attention(q, k, v, index, scale=dim ** -0.5)
    assert_close(out, lse, q, k, v, index_mask_fn(index, q_len, kv_len, q_heads // kv_heads))
    _assert_same(out, lse, *block_sparse_attention(q, k, v, index, config=_triton_config(dim)))


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (sm_90)")
def test_default_launch_takes_it_and_fills_given_buffers():
    """block_sparse_attention routes a plain launch here, writing into the caller's out/lse; rows with no
    admitted key stay zeros with lse -inf."""
    q, k, v = qkv(1, 4, 2, 256, 256, 128, torch.bfloat16)
    index = random_index(1, 2, 256, 256, 64, 64, density=0.5, head_space="kv", device="cuda")
    index = dataclasses.replace(index, full_count=index.full_count.clone(), partial_count=index.partial_count.clone())
    index.full_count[0, 0, 1] = 0
    index.partial_count[0, 0, 1] = 0  # query block 1 of kv head 0: nothing admitted
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:3], float("nan"), device="cuda")
    got_o, got_l = block_sparse_attention(q, k, v, index, out=out, lse=lse)
    assert got_o.data_ptr() == out.data_ptr() and got_l.data_ptr() == lse.data_ptr()
    assert_close(out, lse, q, k, v, index_mask_fn(index, 256, 256, 2))
    assert bool((out[0, :2, 64:128] == 0).all()) and bool((lse[0, :2, 64:128] == float("-inf")).all())


VS_CASES = [
    # batch, q_heads, kv_heads, q_len, kv_len, dim, dtype, verticals, slashes, slash reach, index batch
    (2, 4, 2, 300, 333, 64, torch.float16, 120, 3, 40, 2),  # near-diagonal slashes: long clean runs, unmasked tiles
    (1, 8, 2, 450, 450, 128, torch.bfloat16, 200, 7, None, 1),  # far slashes break the runs: masked slot tiles
    (2, 2, 1, 100, 260, 128, torch.bfloat16, 90, 2, 40, 1),  # bottom-right; one index expanded to the batch
    (1, 6, 2, 300, 300, 64, torch.float16, 100, 4, None, 1),  # a group of 3 at d 64: three warpgroups, Q in smem
    (1, 6, 2, 300, 300, 128, torch.bfloat16, 100, 4, None, 1),  # a group of 3 at d 128: three, O through Q
    (1, 8, 2, 300, 300, 64, torch.bfloat16, 100, 4, None, 1),  # a group of 4 at d 64: four warpgroups
    (2, 16, 2, 100, 260, 64, torch.float16, 90, 3, 40, 1),  # a group of 8 at d 64: two items of four, bottom-right
    (1, 14, 2, 300, 300, 64, torch.bfloat16, 100, 4, None, 1),  # groups of 7 at d 64: threes with a table
    (1, 12, 2, 300, 300, 64, torch.bfloat16, 100, 4, None, 1),  # a group of 6 at d 64: two items of three
    (1, 10, 2, 300, 300, 128, torch.bfloat16, 100, 4, None, 1),  # groups of 5 at d 128: 3 + 2, O through Q
    (2, 2, 2, 300, 333, 128, torch.bfloat16, 150, 5, None, 1),  # MHA: 5 query blocks, each item's two spans differ
]


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (sm_90)")
@pytest.mark.parametrize("case", VS_CASES, ids=lambda c: "b{}_hq{}_hk{}_q{}_k{}_d{}".format(*c[:6]))
def test_column_table_matches_oracle_and_the_column_lists(case):
    """Vertical-slash indexes: the table's slot tiles (clean runs unmasked, the rest masked by bits and causality)
    after the slash blocks equal the oracle and the Triton kernel reading the column lists, through the default
    route; zeroing the table's bits moves the output, so the launch reads the table."""
    batch, q_heads, kv_heads, q_len, kv_len, dim, dtype, n_vert, n_slash, reach, index_batch = case
    q, k, v = qkv(batch, q_heads, kv_heads, q_len, kv_len, dim, dtype)
    lines = vs_lines(index_batch, kv_heads, q_len, kv_len, n_vert, n_slash, "kv", reach=reach)
    index = vertical_slash.index_from_lines(lines, block_m=64, block_n=64).expand_batch(batch)
    validate(index, q_len, kv_len)
    table = index.col_table
    assert ws.ws_eligible(q, k, v, index) and bool((table.span > table.clean).any())
    out, lse = ws.block_sparse_ws_attention(q, k, v, index, scale=dim ** -0.5)
    mask_fn = index_mask_fn(index, q_len, kv_len, q_heads // kv_heads)
    assert_close(out, lse, q, k, v, mask_fn)
    routed = block_sparse_attention(q, k, v, index)
    assert torch.equal(routed[0], out) and torch.equal(routed[1], lse)
    _assert_same(out, lse, *block_sparse_attention(q, k, v, index, config={**_triton_config(dim), "col_table": False}))
    blank = dataclasses.replace(index, col_table=table.map(lambda name, t: torch.zeros_like(t) if name == "bits" else t))
    assert not torch.allclose(ws.block_sparse_ws_attention(q, k, v, blank, scale=dim ** -0.5)[0], out)


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (sm_90)")
@pytest.mark.parametrize("kind", ["window", "table"])
def test_head_subset_serves_its_heads_only(kind):
    """A launch with a head map (the runtime's per-pattern groups): index row i is KV head heads[i]; its query
    heads equal a whole-index launch of the Triton kernel, the other heads of out/lse are left as they were."""
    q, k, v = qkv(2, 8, 4, 260, 260, 128, torch.bfloat16)
    if kind == "table":
        index = vertical_slash.index_from_lines(vs_lines(2, 4, 260, 260, 70, 3, "kv", reach=40), block_m=64, block_n=64)
    else:
        index = random_index(2, 4, 260, 260, 64, 64, density=0.6, window=90, sink=8, head_space="kv", device="cuda")
    served = torch.tensor([3, 0], dtype=torch.int32, device="cuda")
    rows = served.long()
    sub = dataclasses.replace(
        index, **{n: getattr(index, n)[:, rows] for n in ("full_count", "full_idx", "partial_count", "partial_idx", "col_count", "col_idx")
                  if getattr(index, n) is not None},
        col_table=None if index.col_table is None else index.col_table.map(lambda _, t: t[:, rows]))
    assert ws.ws_eligible(q, k, v, sub)
    out = torch.full_like(q, 7.0)
    lse = torch.full(q.shape[:3], 7.0, device="cuda")
    block_sparse_attention(q, k, v, sub, heads=served, out=out, lse=lse)
    direct_o, direct_l = ws.block_sparse_ws_attention(q, k, v, sub, scale=128 ** -0.5, heads=served,
                                                      out=torch.full_like(q, 7.0), lse=torch.full_like(lse, 7.0))
    assert torch.equal(direct_o, out) and torch.equal(direct_l, lse)  # the default route took this kernel
    want_o, want_l = block_sparse_attention(q, k, v, index, config=_triton_config(128))
    q_heads = [h for kv in served.tolist() for h in (2 * kv, 2 * kv + 1)]
    others = [h for h in range(8) if h not in q_heads]
    _assert_same(out[:, q_heads], lse[:, q_heads], want_o[:, q_heads], want_l[:, q_heads])
    assert bool((out[:, others] == 7.0).all()) and bool((lse[:, others] == 7.0).all())


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (sm_90)")
def test_runtime_layout_is_read_and_written_in_place():
    """transformers' [B, N, H, D] buffers seen as [B, H, N, D] (the runtime's q/k/v and out): the same bits as
    contiguous tensors, through the default route, with no copy."""
    q, k, v = qkv(2, 4, 2, 200, 200, 128, torch.bfloat16)
    index = random_index(2, 2, 200, 200, 64, 64, density=0.6, window=120, sink=16, head_space="kv", device="cuda")
    want_o, want_l = ws.block_sparse_ws_attention(q, k, v, index, scale=128 ** -0.5)
    strided = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]
    out = torch.empty(2, 200, 4, 128, dtype=q.dtype, device="cuda").transpose(1, 2)
    got_o, got_l = block_sparse_attention(*strided, index, out=out)
    assert got_o.data_ptr() == out.data_ptr()
    assert torch.equal(got_o, want_o) and torch.equal(got_l, want_l)


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (sm_90)")
@pytest.mark.parametrize("kind", ["blocks", "window", "table", "heads", "odd_heads", "triple_heads", "quad_heads",
                                  "triple_table", "quad_table", "mha_heads", "mha_table"])
def test_items_from_the_counter_give_the_same_bits_on_any_grid(kind):
    """One CTA walking every item (the Q ring, the item slots and the K/V ring across item boundaries), three CTAs
    racing for tickets, and the default grid: the same bits, because an item's math does not depend on who runs it.
    odd_heads: groups of 7 under a head map at d 128, in items of three and two heads (one warpgroup idling
    through the ring, still freeing its Q buffer, which O leaves through); triple_heads: groups of 3, three
    warpgroups per item, O through the Q buffers (d 128); quad_heads: groups of 7 at d 64, four warpgroups, items
    of four and three heads (one warpgroup idling); triple_table / quad_table: a column table read by three
    warpgroups (d 128) and four (groups of 4 at d 64); mha_*: MHA items of two query blocks whose tiles alternate in
    the ring, one side empty in some items."""
    group = {"odd_heads": 7, "triple_heads": 3, "quad_heads": 7, "triple_table": 3, "quad_table": 4, "mha_heads": 1,
             "mha_table": 1}.get(kind, 2)
    dim = 64 if kind.startswith("quad") else 128
    q, k, v = qkv(2, 4 * group, 4, 333, 333, dim, torch.bfloat16)
    heads = torch.tensor([3, 1], dtype=torch.int32, device="cuda") if kind.endswith("heads") else None
    if kind.endswith("table"):
        index = vertical_slash.index_from_lines(vs_lines(2, 4, 333, 333, 70, 3, "kv", reach=40), block_m=64, block_n=64)
    else:
        window = dict(window=90, sink=8) if kind == "window" else {}
        index = random_index(2, 4 if heads is None else 2, 333, 333, 64, 64, density=0.6, head_space="kv",
                             device="cuda", **window)
    if kind in ("odd_heads", "triple_heads", "quad_heads", "mha_heads"):  # items with no key tile between full ones: each still frees the item before's Q
        index = dataclasses.replace(index, full_count=index.full_count.clone(), partial_count=index.partial_count.clone())
        index.full_count[:, 0, 1:3] = 0
        index.partial_count[:, 0, 1:3] = 0
    runs = [ws.block_sparse_ws_attention(q, k, v, index, scale=dim ** -0.5, heads=heads, programs=n,
                                         out=torch.zeros_like(q), lse=torch.zeros(q.shape[:3], device="cuda"))
            for n in (None, 1, 3)]
    for out, lse in runs[1:]:
        assert torch.equal(out, runs[0][0]) and torch.equal(lse, runs[0][1])
    if heads is None:
        assert_close(*runs[0], q, k, v, index_mask_fn(index, 333, 333, group))
    else:
        served = [kv * group + j for kv in heads.tolist() for j in range(group)]
        want_o, want_l = block_sparse_attention(q, k, v, index, heads=heads, config=_triton_config(dim))
        _assert_same(runs[0][0][:, served], runs[0][1][:, served], want_o[:, served], want_l[:, served])


def test_programs_below_one_are_refused():
    q = torch.empty(1, 2, 64, 128, dtype=torch.bfloat16)
    index = random_index(1, 1, 64, 64, 64, 64, density=1.0, head_space="kv")
    with pytest.raises(ValueError, match="programs must be >= 1, got 0"):
        ws.block_sparse_ws_attention(q, q[:, :1], q[:, :1], index, scale=1.0, programs=0)
