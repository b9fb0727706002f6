"""MMInference's kernel-aware per-head search (paper 000 Alg. 4): search spaces as data (space.py),
per-layer scoring (layer.py), cross-modality regions and boundary types (boundary.py), kernel costs
(cost.py)."""
