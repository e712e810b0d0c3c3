"""The expression grammar: printed trees parse back equal; malformed text is one MaskError that points at it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from maskcli.errors import MaskError
from maskcli.expression import And, Call, Ints, Not, Or, Text, both, call_text, either, leaves, parse, print_tree, simplified, with_leaves

names = st.sampled_from(["causal", "window", "document", "tril", "x", "my_kind2"])
ints = st.integers(-(10**12), 10**12)
int_rows = st.lists(st.lists(ints, min_size=1, max_size=4), min_size=1, max_size=3).map(lambda rows: tuple(map(tuple, rows)))
files = st.text(alphabet="abc._/-0123", min_size=1, max_size=12)
words = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,6}", fullmatch=True)


@st.composite
def calls(draw):
    name = draw(names)
    if not draw(st.booleans()):
        return Call(name)
    positional = draw(st.one_of(st.none(), int_rows.map(Ints), files.map(Text)))
    keyword_values = st.one_of(
        ints.map(lambda v: Ints(((v,),))), int_rows.map(lambda r: Ints(r, bracketed=True)), files.map(Text),
        words.map(lambda w: Text(w, quoted=False)),
    )
    keys = draw(st.lists(words, max_size=3, unique=True))
    return Call(name, positional, tuple((key, draw(keyword_values)) for key in keys), called=True)


trees = st.recursive(
    calls(),
    lambda inner: st.one_of(
        inner.map(Not),
        st.lists(inner, min_size=2, max_size=3).map(lambda items: both(*items)),
        st.lists(inner, min_size=2, max_size=3).map(lambda items: either(*items)),
    ),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(trees)
def test_printed_trees_parse_back_equal(tree):
    text = print_tree(tree)
    assert parse(text) == tree
    assert print_tree(parse(text)) == text


@pytest.mark.parametrize(
    "text",
    [
        "causal", "full", "window(3)", "prefix(2)", "sink(2)", "local(4)", "tril(-1)", "triu(1)",
        "chunk(0,0,1,1)", "document(0,0,1,1)", "segment(0,0,1,1)", "blocks(-1,0,0,-1)", "tree(-1,0,0,1)",
        "document(sizes=[3,5])", 'document("labels.npy")', "document(0,0,0,1,1,1) & window(2)",
        "causal | blocks(-1,-1,0,0,0,-1)", "causal & (window(3) | sink(1))", "~triu(1)", "triu(1, means=keep)",
        "document(0,0,1;0,1,1)",
    ],
)
def test_the_issue_forms_are_canonical(text):
    assert print_tree(parse(text)) == text


def test_precedence_and_flattening():
    tree = parse("a | b & ~c & (d | e)")
    assert tree == Or((Call("a"), And((Call("b"), Not(Call("c")), Or((Call("d"), Call("e")))))))
    assert parse("(a & b) & c") == parse("a & (b & c)") == And((Call("a"), Call("b"), Call("c")))
    assert [call.name for call in leaves(parse("~a | b & c"))] == ["a", "b", "c"]
    assert print_tree(parse("  window( 3 )&causal ")) == "window(3) & causal"
    assert parse("window(+3)") == parse("window(3)")


@pytest.mark.parametrize(
    ("text", "at", "says"),
    [
        ("causal & & window(3)", 10, "expected a kind name, '(' or '~', found '&'"),
        ("causal & (window(3)", 20, "expected ')' to close the '('"),
        ("window(3", 9, "in the arguments of window, found the end"),
        ("window(3,)", 10, "expected name=value after the first argument"),
        ("tril(means=keep, means=block)", 18, "each name once, not means again"),
        ("causal $ window", 8, "unexpected character '$'"),
        ("window(3) window(4)", 11, "expected '&', '|' or the end"),
        ("document(sizes=[3,5)", 20, "expected ']' to close the list"),
        ("document(sizes=[3,x])", 19, "expected an integer, found 'x'"),
        ("document(sizes=[3,])", 19, "expected an integer, found ']'"),
        ("~", 2, "found the end"),
        ("(causal", 8, "expected ')'"),
        ("tril(means=)", 12, "a value after means="),
    ],
)
def test_malformed_text_points_at_the_character(text, at, says):
    with pytest.raises(MaskError) as error:
        parse(text)
    message = str(error.value)
    assert says in message
    assert f"at character {at};" in message or f"at character {at} (" in message
    assert repr(text) in message
    assert "\n" not in message and ">>" not in message
    assert error.value.pointer == (text, at - 1)  # drawn as a caret under the text on a terminal


def test_empty_and_huge_expressions_are_refused():
    with pytest.raises(MaskError, match="empty"):
        parse("   ")
    with pytest.raises(MaskError, match="put long labels in a file"):
        parse("chunk(" + "0," * (1 << 20) + "0)")


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="ds(izes=[,;])0123 -+", max_size=30))
def test_sizes_read_by_split_are_the_tokenizers_tree_or_its_error(text):
    """kind(sizes=[...]) is read without the tokenizer (a million sizes took it a minute): the same tree, or the
    same refusal, as the token-at-a-time parser (expression._Parser) gives."""
    from maskcli.expression import _Parser

    for written in (text, f"document(sizes=[{text}])"):
        try:
            parser = _Parser(written)
            slow = parser.expression()
            slow = slow if parser.token.kind == "end" else None
        except MaskError:
            slow = None
        try:
            fast = parse(written)
        except MaskError:
            fast = None
        if slow is not None and isinstance(slow, Call) and slow.name == "document":
            assert fast == slow, written


def test_a_million_sizes_parse_as_one_call():
    tree = parse("document(sizes=[" + ",".join(["1"] * 1_000_000) + "])", None)
    assert tree == Call("document", None, (("sizes", Ints(((1,) * 1_000_000,), bracketed=True)),), called=True)


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet="abcw()[],;=&|~ 0123-\"'$", max_size=30))
def test_any_text_parses_or_is_one_mask_error(text):
    try:
        parse(text)
    except MaskError as error:
        assert "\n" not in str(error)


# --- folding repeats: the same Boolean function of the leaves, fewer items ----------------------------------

few_leaves = st.sampled_from([Call("a"), Call("b"), Call("c"), Call("window", Ints(((3,),)), called=True)])
repeating_trees = st.recursive(
    few_leaves,
    lambda inner: st.one_of(
        inner.map(Not),
        st.lists(inner, min_size=2, max_size=4).map(lambda items: both(*items)),
        st.lists(inner, min_size=2, max_size=4).map(lambda items: either(*items)),
    ),
    max_leaves=12,
)


def truth(tree, value: dict) -> bool:
    """The tree's value when each leaf has the truth value `value[leaf]` (an independent evaluator)."""
    if isinstance(tree, And):
        return all(truth(item, value) for item in tree.items)
    if isinstance(tree, Or):
        return any(truth(item, value) for item in tree.items)
    if isinstance(tree, Not):
        return not truth(tree.item, value)
    return value[tree]


@settings(max_examples=400, deadline=None)
@given(repeating_trees)
def test_folding_repeats_keeps_the_boolean_function_of_every_leaf(tree):
    import itertools

    folded = simplified(tree)
    names = list(dict.fromkeys(leaves(tree)))
    for bits in itertools.product([False, True], repeat=len(names)):
        value = dict(zip(names, bits))
        assert truth(folded, value) == truth(tree, value), (print_tree(tree), print_tree(folded), bits)
    assert len(leaves(folded)) <= len(leaves(tree))
    assert simplified(folded) == folded
    assert parse(print_tree(folded)) == folded  # still a tree the grammar prints and reads back


@pytest.mark.parametrize(
    ("text", "folded"),
    [
        ("a & a & a", "a"),
        ("a | a", "a"),
        ("~~a", "a"),
        ("a & (a | b)", "a"),
        ("a | b & a", "a"),
        ("a & b & a & (c | b)", "a & b"),
        ("(a & b) & (b & a)", "a & b"),
        ("window(3) & window(5) & window(3)", "window(3) & window(5)"),  # different leaves stay
        ("~(a & a) | ~a", "~a"),
    ],
)
def test_folding_examples(text, folded):
    assert print_tree(simplified(parse(text))) == folded


@pytest.mark.parametrize("join", [" & ", " | ", " & ~"])
def test_a_chain_of_ten_thousand_terms_parses_without_recursing_per_term(join):
    text = join.join(["window(3)"] * 10_000)
    tree = parse(text)
    assert len(leaves(tree)) == 10_000
    assert isinstance(tree, And if "&" in join else Or) and len(tree.items) == 10_000
    assert print_tree(tree) == text
    expected = "window(3) & ~window(3)" if "~" in join else "window(3)"
    assert print_tree(simplified(tree)) == expected



def test_with_leaves_replaces_each_leaf_left_to_right_and_keeps_the_tree():
    tree = parse("causal & ~(window(3) | sink(1)) & window(3)")
    assert [call_text(leaf) for leaf in leaves(tree)] == ["causal", "window(3)", "sink(1)", "window(3)"]
    named = with_leaves(tree, ["a", "b", "c", "d"])
    assert leaves(named) == ["a", "b", "c", "d"]
    assert print_tree(named, leaf=str) == "a & ~(b | c) & d"
    assert with_leaves(tree, leaves(tree)) == tree


@pytest.mark.parametrize("text", [["causal"], b"causal", 3, ("window(2)",)])
def test_an_expression_that_is_not_a_str_is_a_type_error_saying_so(text):
    """parse([...]) and build([...]) ended in AttributeError: 'list' object has no attribute 'strip'."""
    from maskcli import build

    for call in (parse, build):
        with pytest.raises(TypeError, match="a mask expression is a str"):
            call(text)
