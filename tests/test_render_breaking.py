"""maskcli.render.breaking: lines break only between tokens (spaces, a path's '.', a list's ','), nothing is lost, and
a table whose columns cannot keep their tokens whole gives its lines instead."""

from __future__ import annotations

import io
import re

from hypothesis import given
from hypothesis import strategies as st

from maskcli.render.breaking import Breaking, Fitted, break_points, tokens


def test_tokens_end_after_a_dot_a_comma_a_slash_or_spaces_but_not_inside_a_number_an_ellipsis_or_a_file_name():
    assert tokens("model.layers.{0-1}.self_attn ×2") == ["model.", "layers.", "{0-1}.", "self_attn ", "×2"]
    assert tokens("(--lengths 9,7,5) share 0.65 ...") == ["(--lengths ", "9,", "7,", "5) ", "share ", "0.65 ", "..."]
    assert tokens("tests/bugs/decode.py:19 run.py") == ["tests/", "bugs/", "decode.py:19 ", "run.py"]  # a file name whole


words = st.lists(st.text("ab_.,", min_size=1, max_size=14), min_size=1, max_size=12).map(" ".join)


@given(words, st.integers(4, 30), st.integers(0, 3))
def test_pieces_join_back_fit_their_width_and_are_cut_inside_a_token_only_when_it_is_wider(line, width, indent):
    breaks = break_points(line, width, indent)
    pieces = [line[a:b] for a, b in zip([0, *breaks], [*breaks, len(line)])]
    assert "".join(pieces) == line  # nothing dropped
    for number, piece in enumerate(pieces):
        room = width if number == 0 else max(1, width - indent)
        assert len(piece.rstrip()) <= room, (pieces, width)
    ends = {0}  # the offsets where a token ends, in the line
    for token in tokens(line):
        ends.add(max(ends) + len(token))
    for at in breaks:  # a cut inside a token is only for a token wider than any line
        if at not in ends:
            start = max(e for e in ends if e < at)
            token = line[start:min(e for e in ends if e > at)].rstrip()
            assert len(token) > max(1, width - indent), (line, at, token)


def render(renderable, width: int) -> list[str]:
    from rich.console import Console

    console = Console(file=io.StringIO(), width=width, no_color=True)
    console.print(renderable)
    return console.file.getvalue().splitlines()


def test_a_table_keeps_tokens_whole_and_indents_its_wrapped_lines_or_gives_its_lines_where_they_read_better():
    from rich.text import Text

    from maskcli.render import hanging

    path = "language_model_decoder.transformer_layers.{0-1}.self_attention_block.attention_core"
    rows = [[Breaking(Text(path), indent=1), Breaking(Text("causal (--lengths 9,7,5,3,8)"), indent=1)]]
    table = Fitted([("calls", {}), ("mask", {})], rows, [hanging("#0 ", Text(f"causal (--lengths 9,7,5,3,8) · {path}"))])
    assert [line.rstrip() for line in render(table, 120)] == [  # written here: where each row fits its line, the table
        "",
        f" {'calls':<{len(path)}}  mask",
        " " + "─" * (len(path) + 2 + len("causal (--lengths 9,7,5,3,8)")),
        f" {path}  causal (--lengths 9,7,5,3,8)",
        ""]
    # at 60 the table's path would take four lines a row: the group's line says it in three, its pieces ending at a
    # '.' and standing under its text
    assert [line.rstrip() for line in render(table, 60)] == [
        "#0 causal (--lengths 9,7,5,3,8) · language_model_decoder.",
        "   transformer_layers.{0-1}.self_attention_block.",
        "   attention_core"]
    # at 30 'language_model_decoder.' and '(--lengths' do not fit side by side: the line, its tokens whole
    assert [line.rstrip() for line in render(table, 30)] == [
        "#0 causal (--lengths", "   9,7,5,3,8) ·", "   language_model_decoder.", "   transformer_layers.{0-1}.",
        "   self_attention_block.", "   attention_core"]


def test_a_lead_wider_than_a_third_of_the_line_wraps_the_whole_line_two_cells_in():
    """`maskcli trace a_long_program_name.py: 1 attention call`: under a lead that takes most of the line, the text's
    column would be a letter wide; the line wraps as one instead, its further lines two cells in."""
    from rich.text import Text

    from maskcli.render import hanging

    lead = "maskcli trace fairseq_vggtransformer_encoder_layer_drops_context_attn_mask.py: "
    assert [line.rstrip() for line in render(hanging(lead, Text("1 attention call in 1 group")), 80)] == [
        "maskcli trace fairseq_vggtransformer_encoder_layer_drops_context_attn_mask.py: 1",
        "  attention call in 1 group"]
    assert [line.rstrip() for line in render(hanging("#0 ", Text("causal · model.layers.0")), 80)] == [
        "#0 causal · model.layers.0"]
