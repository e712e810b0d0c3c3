"""checks/builtcausal.py: an attention module holding causal=True under a model the script built not causal
(causal-under-encoder), and trace/builtflag.py's reading of the statement that built it."""

from __future__ import annotations

from pathlib import Path

from checkbugs import check_bug, first, traced

DIRECTIONS = Path(__file__).parent / "data" / "directions"


def test_local_heads_built_causal_in_an_encoder(tmp_path):
    # lucidrains/routing-transformer 57b1573: SelfAttention built LocalAttention(window, causal = True) whatever the
    # RoutingTransformer was asked; the encoder (causal=False) never saw the later tokens of its windows
    hit = check_bug(tmp_path, "routing_transformer_selfattention_local_heads_always_causal", "causal-under-encoder")[0]
    assert hit["expected"] == "bidirectional" and hit["source"].startswith("RoutingTransformer(causal=False) at line ")
    # blocked scores (B*H, windows, 8 queries, 16 keys: the window before and its own): the queries are the last 8
    assert tuple(hit["cell"]) == first((1, 8, 16), lambda b, q, k: k > q + 8)


def test_blocks_built_causal_under_an_encoder_built_bidirectional(tmp_path):
    """Written another way: `Encoder(..., bidirectional=True)`, its blocks built `is_causal=True`, a tril and-ed with a
    right-padded batch's key padding for SDPA; the fix hands `is_causal=not bidirectional` down."""
    hit = check_bug(tmp_path, "encoder_built_bidirectional_attention_hardcodes_causal", "causal-under-encoder",
                    DIRECTIONS)[0]
    assert "Attention.is_causal" in hit["message"] and "Encoder(bidirectional=True)" in hit["source"]
    assert tuple(hit["cell"]) == first((2, 7, 7), lambda b, q, k: k > q)


def test_a_causal_module_under_a_model_built_with_no_word_is_quiet(tmp_path):
    """The same encoder built without `bidirectional=`: nothing states it both ways, its causal blocks are its own."""
    source = (DIRECTIONS / "encoder_built_bidirectional_attention_hardcodes_causal.py").read_text()
    program = tmp_path / "encoder_no_word.py"
    program.write_text(source.replace("Encoder(16, depth=2, bidirectional=True)", "Encoder(16, depth=2)"))
    status, found, report = traced(tmp_path, "encoder_no_word", False, tmp_path)
    assert status == 0 and not [f for f in found if f["code"] == "causal-under-encoder"], report
