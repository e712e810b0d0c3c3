"""checks/stages.py: the findings about attention run through a mask (attend), each against an independent reference
written here (torch.triu over the cells, torch.isinf of the overflow itself, the fill as each dtype stores it)."""

from __future__ import annotations

import pytest
import torch

from maskcli.attention.findings import mask_findings, run_findings
from maskcli.attention.stages import attend, fill_value
from flags import about, from_flags
from test_attention import EVERY_KIND, qkv_for


def test_minus_1e9_in_float16_becomes_minus_inf_and_is_found():
    spec = from_flags("padding", lengths="3,0")
    keep = spec.materialize()
    q, k, v = qkv_for(spec, dtype=torch.float16)
    stages = attend(q, k, v, keep, fill="-1e9")
    assert bool(torch.isneginf(stages.masked[1]).all())
    assert bool(torch.isnan(stages.weights[1]).all())
    codes = [f.code for f in run_findings(stages, about("padding"))]
    assert codes == ["fill-overflow", "fully-masked"]
    overflow = run_findings(stages, about("padding"))[0].message
    assert "float16" in overflow and "-inf" in overflow
    # the same fill in float32 and bfloat16 fits: uniform rows, no overflow finding
    for dtype in (torch.float32, torch.bfloat16):
        fits = attend(*qkv_for(spec, dtype=dtype), keep, fill="-1e9")
        assert [f.code for f in run_findings(fits, about("padding"))] == ["fully-masked"], dtype
        assert "uniform" in run_findings(fits, about("padding"))[0].message
    # min never overflows, and -1e9 without a fully masked row is still worth saying in float16
    assert [f.code for f in run_findings(attend(q, k, v, keep, fill="min"), about("padding"))] == ["fully-masked"]
    clean_spec = from_flags("causal", length=3)
    clean = attend(*qkv_for(clean_spec, dtype=torch.float16), clean_spec.materialize(), fill="-1e9")
    assert [f.code for f in run_findings(clean, about("causal"))] == ["fill-overflow"]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_hf_eager_rows_that_see_no_key_per_dtype(dtype):
    # + finfo(dtype).min, softmax in float32: float64's min is -inf there, the others' are finite
    spec = from_flags("padding", lengths="3,0")
    keep = spec.materialize()
    stages = attend(*qkv_for(spec, dtype=dtype), keep, like="hf-eager")
    assert bool((stages.masked[1] == torch.finfo(dtype).min).all())  # the bias is the dtype's own min, not an overflow
    [finding] = run_findings(stages, about("padding"))
    assert finding.code == "fully-masked"
    if dtype == torch.float64:
        assert bool(torch.isnan(stages.weights[1]).all())
        assert "NaN, because finfo(float64).min is -inf in the float32 softmax" in finding.message
    else:
        assert torch.equal(stages.weights[1], torch.full_like(stages.weights[1], 1 / 3))  # 1/3 as the dtype holds it
        assert "uniform (1/3 on every key)" in finding.message


def codes_of(kind, *, fill="-inf", dropout=0.0, dtype=torch.float32, **options):
    spec = from_flags(kind, heads=2, **options)
    keep = spec.materialize()
    stages = attend(*qkv_for(spec, dtype=dtype), keep, fill=fill, dropout=dropout, seed=3)
    return [f.code for f in run_findings(stages, spec)], run_findings(stages, spec)


# What each example of EVERY_KIND should be told: most nothing; a shifted diagonal shows its effect.
EXPECTED_CODES = {
    "tril": ["fully-masked"],  # diagonal -1: query 0 sees no key
    "tril-keep-d1": ["sees-later"],  # diagonal 1: each query sees the next key
    "triu-d2": ["sees-later"],  # block above diagonal 2: each query sees the next key
}


@pytest.mark.parametrize("name", list(EVERY_KIND))
def test_findings_for_every_kind_example_under_every_fill(name):
    kind, options = EVERY_KIND[name]
    for fill in ("-inf", "min", "-1e9", "multiply"):
        assert sorted(codes_of(kind, fill=fill, **options)[0]) == EXPECTED_CODES.get(name, []), (name, fill)


def test_fully_masked_finding_names_the_rows_and_what_they_became():
    codes, findings = codes_of("padding", lengths="3,0")
    assert codes == ["fully-masked"]
    assert "0-2" in findings[0].message and "batch 1" in findings[0].message and "NaN" in findings[0].message
    codes, findings = codes_of("padding", lengths="3,0", fill="min")
    assert codes == ["fully-masked"] and "uniform" in findings[0].message and "1/3" in findings[0].message
    codes, findings = codes_of("padding", lengths="3,0", fill="multiply")
    assert codes == ["fully-masked"] and "NaN" in findings[0].message
    # triu with diagonal 1 read as keep: the last query row sees nothing
    codes, findings = codes_of("triu", length=4, means="keep")
    assert "fully-masked" in codes
    assert "query row 3 sees no key" in findings[codes.index("fully-masked")].message


@pytest.mark.parametrize(
    "kind, options, later",
    [
        ("triu", dict(length=4, means="keep"), "query rows 0-2 see later keys"),
        ("tril", dict(length=4, means="block"), "query rows 0-2 see later keys"),
        ("tril", dict(length=4, diagonal=1), "query rows 0-2 see later keys"),
        ("triu", dict(length=4, diagonal=0, means="block"), None),  # keep = strictly lower: earlier keys only
        ("tril", dict(length=4, diagonal=-1), None),
        ("triu", dict(length=4), None),
        ("tril", dict(length=4), None),
    ],
)
def test_sees_later_fires_exactly_when_tril_or_triu_lets_a_query_see_a_later_key(kind, options, later):
    codes, findings = codes_of(kind, **options)
    spec = from_flags(kind, **options)
    keep = spec.materialize()[0, 0]
    expected_later = bool(torch.triu(keep, 1).any())  # independent: any cell right of the diagonal
    assert ("sees-later" in codes) == expected_later == (later is not None)
    if later:
        message = findings[codes.index("sees-later")].message
        assert message.startswith(later) and "--means" in message and "query 0 sees keys 1" in message
    # the same finding about the mask alone
    assert ("sees-later" in [f.code for f in mask_findings(spec.materialize(), spec)]) == expected_later


def test_kinds_that_see_later_keys_by_design_are_not_reported():
    for kind, options in [("prefix", dict(length=5, prefix=3)), ("chunk", dict(chunks="0,0,1,1")), ("padding", dict(lengths="4,2"))]:
        assert "sees-later" not in codes_of(kind, **options)[0], kind


def test_row_sum_fires_with_dropout_and_not_without():
    codes, findings = codes_of("causal", length=6, dropout=0.5)
    assert codes == ["row-sum"] and "0.5" in findings[0].message
    assert codes_of("causal", length=6, dropout=0.0)[0] == []


def test_row_sum_names_rows_whose_weights_do_not_sum_to_one():
    spec = from_flags("causal", length=3)
    keep = spec.materialize()
    stages = attend(*qkv_for(spec), keep)
    broken = stages.weights.clone()
    broken[0, 0, 2] *= 0.5
    from dataclasses import replace

    findings = run_findings(replace(stages, weights=broken), about("causal"))
    assert [f.code for f in findings] == ["row-sum"]
    assert "query row 2 " in findings[0].message


@pytest.mark.parametrize("fill, effect", [("-inf", "NaN"), ("multiply", "NaN"), ("min", "uniform"), ("-1e9", "uniform")])
def test_padded_causal_rows_that_see_nothing_are_found_under_every_fill(fill, effect):
    # causal never hides a query's own key, so only the padding (length 0) empties these rows
    codes, findings = codes_of("causal", length=4, lengths="4,0", fill=fill)
    assert codes == ["fully-masked"]
    assert findings[0].message.startswith("query rows 0-3 see no key (batch 1): ") and effect in findings[0].message


def test_non_finite_scores_are_named_with_their_cause_instead_of_a_row_sum():
    spec = from_flags("causal", length=3)
    keep = spec.materialize()
    q = torch.randn(1, 1, 3, 4, generator=torch.Generator().manual_seed(0))
    q[0, 0, 1, 2] = float("nan")
    findings = run_findings(attend(q, q.nan_to_num(), q.nan_to_num(), keep), about("causal"))
    assert [f.code for f in findings] == ["non-finite"]
    assert findings[0].message.startswith("the scores of query row 1 hold NaN: the inputs carry NaN")
    # 300 * 300 * 2 = 180000 is past float16's largest, 65504: the first query's score overflows
    big = torch.tensor([[300.0, 300.0], [1.0, 1.0], [1.0, 1.0]], dtype=torch.float16)[None, None]
    assert torch.isinf(big[0, 0, 0] @ big[0, 0, 0])  # independent: the overflow itself
    findings = run_findings(attend(big, big, big, keep), about("causal"))
    assert [f.code for f in findings] == ["non-finite"]
    assert "query row 0 hold inf: Q Kᵀ overflows float16 (largest 65504)" in findings[0].message
    assert "compute in float32" in findings[0].message


def test_a_scale_that_overflows_the_dtype_is_named():
    spec = from_flags("causal", length=3)
    q = torch.tensor([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]], dtype=torch.float16)[None, None]
    stages = attend(q, q, q, spec.materialize(), scale=30000.0)
    assert bool(torch.isfinite(stages.scores).all()) and not bool(torch.isfinite(stages.scaled).all())  # independent
    findings = run_findings(stages, about("causal"))
    assert [f.code for f in findings] == ["non-finite"]
    assert findings[0].message.startswith("the scaled scores of query rows 1-2 hold inf: scores × 30000 overflows float16")
    assert findings[0].message.endswith("use a smaller --scale")


def test_fill_overflow_in_float16_is_found():
    assert fill_value("-1e9", torch.float16) == float("-inf")
    assert fill_value("-1e9", torch.float32) == -1e9
    spec = from_flags("padding", lengths="2,0")
    stages = attend(*qkv_for(spec, dtype=torch.float16), spec.materialize(), fill="-1e9")
    codes = [f.code for f in run_findings(stages, spec)]
    assert codes[0] == "fill-overflow" and "fully-masked" in codes
    clean_spec = from_flags("causal", length=3)
    assert run_findings(attend(*qkv_for(clean_spec), clean_spec.materialize()), clean_spec) == []


def test_a_triu_read_as_keep_sees_later_keys():
    spec = from_flags("triu", length=3, means="keep")
    findings = {f.code: f.message for f in run_findings(attend(*qkv_for(spec), spec.materialize()), spec)}
    assert "sees-later" in findings and "--means" in findings["sees-later"]
    assert "triu(1, means=keep) should not allow" in findings["sees-later"]
    assert "fully-masked" in findings and "NaN" in findings["fully-masked"]


def test_expressions_that_see_later_keys_by_design_are_not_reported_and_causal_ones_never_look():
    for text, length in (("causal | blocks(-1,0,0,-1)", None), ("window(2) | sink(1)", 5), ("segment(0,0,1,1)", None)):
        spec = from_flags(text, length=length)
        stages = attend(*qkv_for(spec), spec.materialize())
        assert run_findings(stages, spec) == [], text
    behind = from_flags("document(0,0,1,1,1) & window(2)", offset=2)
    assert behind.causal and run_findings(attend(*qkv_for(behind), behind.materialize()), behind) == []
    later = from_flags("tril(1)", offset=2, length=2)
    (finding,) = mask_findings(later.materialize(), later)
    assert finding.code == "sees-later" and "query 2 sees keys 3" in finding.message


def test_rows_that_see_no_key_are_wrong_where_they_turn_into_nan_and_a_note_where_uniform():
    """As in a trace (checks/rows.py): NaN out of the run is wrong, uniform weights from a finite fill a note; the
    renderers colour by this severity."""
    from maskcli.checks.registry import severity

    spec = from_flags("padding", lengths="3,0")
    for fill, expected in (("-inf", "wrong"), ("multiply", "wrong"), ("min", "note"), ("-1e9", "note")):
        stages = attend(*qkv_for(spec), spec.materialize(), fill=fill)
        nan = bool(torch.isnan(stages.weights[1]).all())  # independent: what the run made of batch row 1
        [finding] = run_findings(stages, spec)
        assert severity(finding) == expected and nan == (expected == "wrong"), fill
