"""SPAVA (paper 001): sequence-parallel approximate prefill on torch.distributed.

layout.py (anchor, ZigZag virtual hosts, query), attention.py (the per-rank attention with its
collectives), reference.py (the one-process oracle), group.py (process groups, child environments).
"""
