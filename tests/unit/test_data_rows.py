"""Prompt data: every row of ../shared/data loads and chat-templates (SmolLM2 and Qwen3 tokenizers);
corrupted copies fail with file:line and field; skipping counts bad rows; length limits are counted."""

from __future__ import annotations

import json
import shutil

import pytest

from srpo_megatron.config import ConfigError, DataConfig, from_dict
from srpo_megatron.data import DataError, PromptDataset, default_data_dir, load_rows
from srpo_megatron.data.assets import qwen3_tokenizer, smollm2_tokenizer
from srpo_megatron.data.templating import template_text

# The README's table: (file, rows).
FILES = [
    *(
        (f"sciknoweval/{d}/{split}.jsonl", n)
        for d, ns in {
            "chemistry": (1890, 210),
            "physics": (720, 80),
            "biology": (450, 50),
            "material": (841, 94),
        }.items()
        for split, n in zip(("train", "test"), ns, strict=True)
    ),
    ("tooluse/test.jsonl", 68),
]


@pytest.fixture(scope="session")
def smollm2():
    return smollm2_tokenizer()


@pytest.fixture(scope="session")
def qwen3():
    return qwen3_tokenizer()


@pytest.mark.parametrize(("relpath", "num_rows"), FILES)
def test_every_row_loads_and_templates(relpath, num_rows, smollm2, qwen3):
    cfg = DataConfig(train_files=[relpath], max_prompt_tokens=100_000)
    for tok, gen_prompt in ((qwen3, "<|im_start|>assistant\n<think>\n\n</think>\n\n"), (smollm2, None)):
        ds = PromptDataset.from_files([relpath], tok, cfg)
        assert len(ds) == num_rows and ds.stats.num_bad == 0 and ds.stats.num_dropped_overlong == 0
        kind = "tooluse" if relpath.startswith("tooluse") else "mcq"
        assert {p.row.kind for p in ds} == {kind}
        assert {p.row.benchmark for p in ds} == {relpath.rsplit("/", 1)[0]}
        for p in ds:
            text = tok.decode(p.ids)
            # The ids are exactly the template's text, which holds the system and user messages verbatim.
            assert text == template_text(tok, p.row.prompt, p.row.system)
            assert p.row.prompt in text
            if kind == "tooluse":
                assert p.row.system is None
            else:
                assert p.row.system is not None and p.row.system in text and p.row.answer in "ABCD"
            if gen_prompt is not None:
                assert text.endswith(gen_prompt)
                assert text.startswith("<|im_start|>system\n" if p.row.system else "<|im_start|>user\n")
            else:
                assert text.endswith("<|im_start|>assistant\n")


def corrupt_copy(tmp_path, edits):
    """A copy of physics/test.jsonl with line -> new text replacements."""
    src = default_data_dir() / "sciknoweval/physics/test.jsonl"
    dst = tmp_path / "physics_bad.jsonl"
    lines = src.read_text().splitlines()
    for lineno, fn in edits.items():
        lines[lineno - 1] = fn(lines[lineno - 1])
    dst.write_text("\n".join(lines) + "\n")
    return dst


def drop_field(name):
    def edit(line):
        rec = json.loads(line)
        del rec[name]
        return json.dumps(rec)

    return edit


def set_field(name, value):
    def edit(line):
        rec = json.loads(line)
        rec[name] = value
        return json.dumps(rec)

    return edit


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda line: line[: len(line) // 2], r":17: not valid JSON"),
        (drop_field("answer"), r":17: field 'answer' is missing"),
        (drop_field("prompt"), r":17: field 'prompt' is missing"),
        (set_field("prompt", ""), r":17: field 'prompt' must be a non-empty string"),
        (set_field("system", 3), r":17: field 'system' must be a string or null"),
        (set_field("kind", "essay"), r":17: field 'kind' is 'essay'; valid kinds are \['arithmetic'"),
        (set_field("answer", None), r":17: field 'answer' must be a string"),
        (lambda line: "[1, 2]", r":17: a row must be a JSON object"),
    ],
)
def test_corrupted_copy_fails_with_file_line_and_field(tmp_path, edit, message):
    bad = corrupt_copy(tmp_path, {17: edit})
    with pytest.raises(DataError, match=rf"physics_bad\.jsonl{message}"):
        load_rows(bad)


def test_skip_bad_rows_counts_them(tmp_path, qwen3):
    bad = corrupt_copy(tmp_path, {3: lambda s: s[:10], 17: drop_field("answer"), 80: set_field("kind", "x")})
    rows, report = load_rows(bad, skip_bad=True)
    assert (len(rows), report.num_bad) == (77, 3)
    assert [e.split(": ")[0].rsplit(":", 1)[1] for e in report.first_errors] == ["3", "17", "80"]
    cfg = DataConfig(train_files=[str(bad)], skip_bad_rows=True)
    ds = PromptDataset.from_files(cfg.train_files, qwen3, cfg)
    assert (len(ds), ds.stats.num_bad, ds.stats.metrics()["data/bad_rows"]) == (77, 3, 3.0)


def test_blank_lines_are_not_rows_and_line_numbers_stay_true(tmp_path):
    src = (default_data_dir() / "tooluse/test.jsonl").read_text().splitlines()
    p = tmp_path / "gaps.jsonl"
    p.write_text(src[0] + "\n\n" + src[1] + "\n" + src[2][:-5] + "\n")
    with pytest.raises(DataError, match=r"gaps\.jsonl:4: not valid JSON"):
        load_rows(p)


def test_parquet_rows_and_row_numbers(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    src = [json.loads(s) for s in (default_data_dir() / "tooluse/test.jsonl").read_text().splitlines()[:5]]
    table = pa.Table.from_pylist([{k: r[k] for k in ("prompt", "system", "answer", "kind")} for r in src])
    good = tmp_path / "tool.parquet"
    pq.write_table(table, good)
    rows, _ = load_rows(good)
    assert [r.answer for r in rows] == [r["answer"] for r in src] and rows[0].system is None
    recs = table.to_pylist()
    recs[3]["kind"] = "bogus"
    pq.write_table(pa.Table.from_pylist(recs), tmp_path / "bad.parquet")
    with pytest.raises(DataError, match=r"bad\.parquet:4: field 'kind'"):
        load_rows(tmp_path / "bad.parquet")


def test_missing_file_and_unknown_format(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_rows(tmp_path / "nope.jsonl")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unknown data format"):
        load_rows(tmp_path / "x.csv")


def test_overlong_prompts_are_dropped_or_truncated_and_counted(qwen3):
    rel = "tooluse/test.jsonl"
    full = PromptDataset.from_files([rel], qwen3, DataConfig(train_files=[rel], max_prompt_tokens=100_000))
    limit = 640  # tool-use prompts are 466..1170 Qwen tokens long
    n_long = sum(len(p.ids) > limit for p in full)
    assert 0 < n_long < len(full)
    dropped = PromptDataset.from_files([rel], qwen3, DataConfig(train_files=[rel], max_prompt_tokens=limit))
    assert len(dropped) == len(full) - n_long and dropped.stats.num_dropped_overlong == n_long
    cfg = DataConfig(train_files=[rel], max_prompt_tokens=limit, overlong="truncate")
    cut = PromptDataset.from_files([rel], qwen3, cfg)
    assert len(cut) == len(full) and cut.stats.num_truncated == n_long
    for p, q in zip(full, cut, strict=True):
        assert len(q.ids) <= limit
        if len(p.ids) <= limit:
            assert q.ids == p.ids and not q.truncated
        else:
            text = qwen3.decode(q.ids)
            # Left truncation keeps the end of the user message (the question) and the chat markup.
            assert text.startswith("<|im_start|>user\n") and text.endswith("<think>\n\n</think>\n\n")
            question = p.row.prompt.rsplit("Question:", 1)[1].strip()
            assert question in text and len(q.ids) >= limit - 40


def test_data_config_is_strict():
    cfg = from_dict(DataConfig, {"train_files": ["a.jsonl"], "arithmetic": {"difficulty": 1}})
    assert cfg.arithmetic is not None and cfg.arithmetic.difficulty == 1
    with pytest.raises(ConfigError, match="unknown key"):
        from_dict(DataConfig, {"train_files": ["a.jsonl"], "max_prompt_len": 3})
    with pytest.raises(ConfigError, match="overlong"):
        from_dict(DataConfig, {"train_files": ["a.jsonl"], "overlong": "cut"})
    with pytest.raises(ConfigError, match="no prompts configured"):
        from_dict(DataConfig, {})
    with pytest.raises(ConfigError, match="difficulty"):
        from_dict(DataConfig, {"arithmetic": {"difficulty": 7}})


def test_data_dir_env_override(tmp_path, monkeypatch):
    shutil.copy(default_data_dir() / "tooluse/test.jsonl", tmp_path / "t.jsonl")
    monkeypatch.setenv("SRPO_DATA_DIR", str(tmp_path))
    assert default_data_dir() == tmp_path.resolve()
    rows, _ = load_rows(default_data_dir() / "t.jsonl")
    assert len(rows) == 68


def test_build_datasets_from_a_recipe_section(qwen3):
    from srpo_megatron.config import ArithmeticTaskConfig
    from srpo_megatron.data import build_datasets

    cfg = from_dict(
        DataConfig,
        {
            "train_files": ["tooluse/test.jsonl"],
            "eval_files": ["sciknoweval/biology/test.jsonl", "sciknoweval/physics/test.jsonl"],
            "arithmetic": {"difficulty": 0, "num_train": 30, "num_eval": 10},
        },
    )
    assert cfg.arithmetic == ArithmeticTaskConfig(difficulty=0, num_train=30, num_eval=10)
    train, evals = build_datasets(cfg, qwen3)
    assert {n: len(ps) for n, ps in train.benchmarks().items()} == {"tooluse": 68, "arithmetic/level0": 30}
    assert {n: len(ps) for n, ps in evals.benchmarks().items()} == {
        "sciknoweval/biology": 50,
        "sciknoweval/physics": 80,
        "arithmetic/level0": 10,
    }
    arith = train.benchmarks()["arithmetic/level0"][0]
    assert qwen3.decode(arith.ids).startswith("<|im_start|>user\nWhat is ")
    train_prompts = {p.row.prompt for p in train.benchmarks()["arithmetic/level0"]}
    assert not train_prompts & {p.row.prompt for p in evals.benchmarks()["arithmetic/level0"]}


@pytest.mark.parametrize(
    ("side", "kept", "lost"), [("left", "ZEBRA", "AARDVARK"), ("right", "AARDVARK", "ZEBRA")]
)
def test_truncation_side(qwen3, side, kept, lost):
    from srpo_megatron.data import Row
    from srpo_megatron.data.templating import encode_prompt

    row = Row("AARDVARK " + "filler words here " * 100 + "ZEBRA", "sys", "1", "arithmetic", "b", "x:1")
    ids, truncated = encode_prompt(qwen3, row, max_tokens=120, side=side)
    text = qwen3.decode(ids)
    assert truncated and len(ids) <= 120 and kept in text and lost not in text
    assert text.startswith("<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\n")
