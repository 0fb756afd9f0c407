"""The --comment key=value form and the job-name form (scheduler.slurm.comment)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.slurm.comment import (
    CommentError, JobFields, format_fields, job_fields, parse_comment, user_part, with_status,
)


def test_documented_form():
    f = job_fields("model=ResNet-50 batch_size=64 batch_sizes=32,64,128", "train")
    assert f == JobFields("ResNet-50", 64, (32, 64, 128), 0)


def test_aliases_separators_and_sizes():
    f = job_fields("model=LM; bs=20;bs_allowed=40,10,20  gpu_mem=12G", "x")
    assert f == JobFields("LM", 20, (10, 20, 40), 12 << 30)
    assert job_fields("model=LM gpu_mem=800MiB", "").gpu_memory_bytes == 800 << 20


def test_name_form_and_precedence():
    assert job_fields("", "ResNet-50@64") == JobFields("ResNet-50", 64)
    assert job_fields("", "Transformer") == JobFields("Transformer", 0)
    # the comment wins over the name, field by field
    assert job_fields("batch_size=32", "ResNet-50@64") == JobFields("ResNet-50", 32)
    assert job_fields("model=LM bs=5", "weird@name") == JobFields("LM", 5)
    # free text (no '=') is not dlshare's: the name decides
    assert job_fields("my experiment, take 3", "LM@20") == JobFields("LM", 20)


def test_batch_size_defaults_to_the_first_allowed():
    assert job_fields("model=LM batch_sizes=64,16", "x").batch_size == 16


@pytest.mark.parametrize("comment,name,words", [
    ("model=LM bs=abc", "", "bs='abc'"),
    ("model=LM bs=0", "", "between 1"),
    ("model=LM bs=\u00b2", "", "positive whole number"),  # str.isdigit() is true of '²'; int() refuses it
    ("model=LM colour=blue", "", "unknown key"),
    ("model=LM model=LM", "", "given twice"),
    ("model=LM batch_sizes=32,,64", "", "comma-separated"),
    ("model=LM batch_size=16 batch_sizes=32,64", "", "not one of"),
    ("model=LM gpu_mem=lots", "", "gpu_mem"),
    ("model= bs=1", "", "model name"),
    ("bs=4 stray", "", "expected key=value"),
    ("", "", "no model"),
    ("", "Net@x", "batch size"),
    ("bs=8", "my job with spaces", "no model"),
])
def test_bad_fields_have_a_clear_reason(comment, name, words):
    with pytest.raises(CommentError) as exc:
        job_fields(comment, name)
    assert words in str(exc.value)


def test_status_is_appended_and_stripped():
    c = with_status("model=LM bs=20", "waiting: needs 4 free GPUs | really")
    assert c == "model=LM bs=20 | dlshare: waiting: needs 4 free GPUs / really"
    assert user_part(c) == "model=LM bs=20"
    assert with_status(c, "placed on n1") == "model=LM bs=20 | dlshare: placed on n1"
    assert with_status("", "held") == "dlshare: held"
    assert user_part("dlshare: held") == ""
    assert parse_comment(c) == {"model": "LM", "batch_size": 20}


models = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._+()/-]{0,20}", fullmatch=True)
fields = st.builds(JobFields, models, st.integers(0, 4096),
                   st.lists(st.integers(1, 4096), max_size=4, unique=True).map(lambda x: tuple(sorted(x))),
                   st.integers(0, 1 << 40))


@given(fields)
def test_format_then_parse_round_trips(f):
    if f.batch_size and f.batch_sizes and f.batch_size not in f.batch_sizes:
        f = JobFields(f.model, f.batch_sizes[0], f.batch_sizes, f.gpu_memory_bytes)
    if not f.batch_size and f.batch_sizes:
        f = JobFields(f.model, f.batch_sizes[0], f.batch_sizes, f.gpu_memory_bytes)
    text = format_fields(f)
    assert job_fields(text, "ignored name") == f
    assert job_fields(with_status(text, "placed on n1 GPU 0"), "") == f


@settings(max_examples=400)
@given(st.text(max_size=120), st.text(max_size=40))
def test_any_text_parses_or_says_why(comment, name):
    try:
        f = job_fields(comment, name)
    except CommentError as exc:
        assert str(exc)
    else:
        assert f.model and f.batch_size >= 0
