"""calibrate's closing lines say what the artifact buys, in words a user can act on (no bare None)."""

from __future__ import annotations

from cli.calibrate import what_it_buys


def test_a_measured_cutoff_says_where_sparse_starts():
    lines = what_it_buys({"mean_density": 0.3125, "dense_cutoff": {"min_tokens": 8192, "source": "measured"}})
    assert lines[0] == "attention computed: 31.2% of dense (mean over heads)"
    assert "dense below 8192 tokens" in lines[1] and "measured on this device" in lines[1]


def test_never_faster_says_so_instead_of_none():
    lines = what_it_buys({"mean_density": 0.5, "dense_cutoff": {"min_tokens": None, "measured_up_to": 4096, "source": "measured"}})
    assert "never faster than dense up to 4096 tokens" in lines[1] and "None" not in " ".join(lines)


def test_a_target_adds_its_cost_fraction():
    lines = what_it_buys({"mean_density": 0.5, "dense_cutoff": None, "target": {"calibration": {"cost_fraction": 0.62}}})
    assert lines == ["attention computed: 50.0% of dense (mean over heads); cost 62.0% of dense under the search's cost model"]


def test_a_mostly_dense_lossless_artifact_says_so_plainly():
    target = {"kind": "max_output_error", "value": 0.02, "calibration": {"cost_fraction": 0.84, "sparse_heads": 21},
              "dense_heads": [{"layer": 0, "head": h} for h in range(69)]}
    lines = what_it_buys({"mean_density": 0.84, "dense_cutoff": None, "target": target, "tokens": 4096})
    assert any("21 of 90 searched heads run sparse, each within output error 0.02 of dense; 69 stay dense" in l
               and "at 4096 tokens this model needs near-dense attention" in l for l in lines), lines
    target["calibration"]["sparse_heads"], target["dense_heads"] = 80, target["dense_heads"][:10]
    lines = what_it_buys({"mean_density": 0.3, "dense_cutoff": None, "target": target, "tokens": 32768})
    assert any("80 of 90 searched heads run sparse" in l and "near-dense" not in l for l in lines), lines
