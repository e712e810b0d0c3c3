"""trace/calledflag.py: a literal causal= / is_causal= the program's own call hands a helper on the way to the kernel."""

from __future__ import annotations

import ast

from maskcli.trace.calledflag import _literal_calls

SOURCE = '''
def run(q, k, v, m):
    a = flash(q, k, v, causal=False)
    b = lib.attention(q, k,
                      v, is_causal=True)
    c = attend(q, k, v, attn_mask=m, is_causal=False)
    d = attend(q, k, v, attn_mask=None, is_causal=False)
    e = attend(q, k, v, causal=flag)
    return a, b, c, d, e
'''


def test_literal_flags_are_read_per_line_with_their_callee(tmp_path):
    path = tmp_path / "prog.py"
    path.write_text(SOURCE)
    found = _literal_calls(str(path))
    # the reference: every line of each call with a literal bool causal / is_causal, read by ast on its own
    expected: dict = {}
    for node in ast.walk(ast.parse(SOURCE)):
        if isinstance(node, ast.Call):
            for kw in node.keywords:
                if kw.arg in ("causal", "is_causal") and isinstance(kw.value, ast.Constant):
                    for line in range(node.lineno, node.end_lineno + 1):
                        expected.setdefault(line, set()).add((kw.arg, kw.value.value))
    assert {line: {(one[1], one[2]) for one in said} for line, said in found.items()} == expected
    assert found[3] == [("flash", "causal", False, False)]
    assert found[4] == found[5] == [("attention", "is_causal", True, False)]  # a call over two lines, either line
    assert found[6] == [("attend", "is_causal", False, True)]  # a mask handed beside it: left to the mask
    assert found[7] == [("attend", "is_causal", False, False)]  # attn_mask=None hands nothing
    assert 8 not in found  # causal=flag: no literal


def test_a_file_that_does_not_parse_says_nothing(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("def f(:\n    pass\n")
    assert _literal_calls(str(path)) == {}
