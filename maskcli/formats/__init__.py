"""Kernel formats: the same mask in each attention library's own form, and back (`maskcli export`, `--from`).

One module per format; registry.py collects them. Every format is built from the mask's
exact key intervals, O(L) where the format is O(L).
"""
