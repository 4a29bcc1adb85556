"""Long documents through submit and run_job, the broker played by a script on the tiny model's tokenizer: a
summarize job's pieces, reduce levels and one result per document; a translation joined in order; documents
that fit stored and answered as ever; resume after an interrupt gives the same results; generate refuses."""

from __future__ import annotations

import json
import re

import pytest

from layerbus.broker.requests import GenerationResult
from layerbus.cli.main import main
from layerbus.jobs.runner import run_job
from layerbus.storage import JobStore
from tests.helpers.fixtures_jobs import tokenizer  # noqa: F401 - fixture
from tests.helpers.scripted_broker import ScriptedBroker, final_rows

SHORT = "The stage receives a batch and sends it on."


def numbered(paragraphs: int) -> str:
    return "\n\n".join(f"Paragraph {n} opens here. It says one thing about item {n}. It ends here."
                       for n in range(1, paragraphs + 1))


def submit(tmp_path, tiny, capsys, task: str, *options: str, documents: dict | None = None) -> tuple[str, str]:
    documents = documents or {"short": SHORT, "long": numbered(12)}
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"id": key, "text": text}) + "\n" for key, text in documents.items()))
    db = f"sqlite:///{tmp_path / 'store.db'}"
    language = ["--target-language", "French"] if task == "translate" else []
    code = main(["submit", str(path), "--task", task, *language, "--model", str(tiny), "--db", db,
                 "--max-new-tokens", "12", *options])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return db, captured.out.strip()


class ParagraphBroker(ScriptedBroker):
    """Answers each request with the paragraph numbers its prompt holds ("P3 P4"), or for a prompt without
    any (a reduce of such answers) with the answers it holds: order is visible in every output."""

    def run(self, source, sink, should_stop, events=None):
        while not source.exhausted and not should_stop():
            batch = source.fetch(self.batch)
            self.requests += batch
            if self.before_deliver is not None:
                self.before_deliver(len(self.requests), batch)
            sink.deliver([self._answer(request) for request in batch])

    def _answer(self, request):
        prompt = self._tokenizer.decode(request.prompt_ids)
        numbers = re.findall(r"Paragraph (\d+) opens", prompt) or re.findall(r"P(\d+)", prompt)
        text = " ".join(f"P{n}" for n in dict.fromkeys(numbers))
        ids = self._tokenizer.encode(text, add_special_tokens=False)
        return GenerationResult(request.request_id, token_ids=ids, text=text, finish_reason="stop",
                                prompt_tokens=len(request.prompt_ids), latency_s=0.01)


def run(db: str, job_id: str, tokenizer, tmp_path, broker=None):
    with JobStore.open(db) as store:
        status = run_job(store, job_id, broker or ParagraphBroker(tokenizer, batch=3), tmp_path / "results",
                         poll_cancel_s=0)
        parts = list(store.job_items(job_id))
    return status, {row["custom_id"]: row for row in final_rows(status.results_path)}, parts


def test_a_summarized_long_document_is_mapped_and_reduced_into_one_row(tmp_path, tiny_models, tokenizer, capsys):
    db, job_id = submit(tmp_path, tiny_models("llama"), capsys, "summarize", "--max-chunk-tokens", "40")
    status, rows, items = run(db, job_id, tokenizer, tmp_path)
    assert status.status == "completed" and status.failed == 0
    assert list(rows) == ["short", "long"], "one row per document, in input order"
    assert rows["long"]["output"] == " ".join(f"P{n}" for n in range(1, 13)), "every piece, in order"
    assert rows["long"]["input"] == numbered(12)
    names = [item.custom_id for item in items]
    assert sum(name.startswith("long#map-") for name in names) >= 4
    assert any(name.startswith("long#reduce-1-") for name in names), "the summaries did not fit one reduce"
    assert main(["status", job_id, "--db", db]) == 0
    report = capsys.readouterr().out
    parts = len(names) - 2
    assert re.search(rf"\ndocuments +2 total, 1 split \(1 done\) into {parts} part\(s\), {parts} done\n", report)
    output, errors = tmp_path / "output.jsonl", tmp_path / "errors.jsonl"
    assert main(["results", job_id, "--format", "openai", "--output", str(output), "--errors", str(errors),
                 "--db", db]) == 0
    lines = [json.loads(line) for line in output.read_text().splitlines()]
    assert [line["custom_id"] for line in lines] == ["short", "long"], "one OpenAI line per input line"


def test_a_translated_long_document_is_joined_in_order_without_a_reduce(tmp_path, tiny_models, tokenizer, capsys):
    db, job_id = submit(tmp_path, tiny_models("llama"), capsys, "translate", "--max-chunk-tokens", "40")
    status, rows, items = run(db, job_id, tokenizer, tmp_path)
    assert status.status == "completed"
    pieces = [item for item in items if item.custom_id.startswith("long#piece-")]
    assert len(pieces) >= 4 and not any("reduce" in item.custom_id for item in items)
    assert rows["long"]["output"].split() == [f"P{n}" for n in range(1, 13)], "each paragraph once, in order"
    breaks = [item.params.get("join_before") for item in pieces[1:]]
    assert rows["long"]["output"].count("\n\n") == breaks.count("\n\n"), "a break where a piece starts a paragraph"
    assert set(breaks) == {" ", "\n\n"}, "paragraphs longer than a piece are cut at sentence ends"


def test_documents_that_fit_are_stored_and_answered_as_without_splitting(tmp_path, tiny_models, tokenizer, capsys):
    documents = {"short": SHORT, "other": "A second short document, about stages."}
    outputs = []
    for mode in ("split", "fail"):
        folder = tmp_path / mode
        folder.mkdir()
        db, job_id = submit(folder, tiny_models("llama"), capsys, "summarize", "--long-documents", mode,
                            documents=documents)
        status, rows, items = run(db, job_id, tokenizer, folder, ScriptedBroker(tokenizer, batch=2))
        outputs.append(([(i.custom_id, i.prompt, i.params, i.seq) for i in items],
                        [(r["custom_id"], r["output"], r["prompt_tokens"]) for r in rows.values()]))
    assert outputs[0] == outputs[1]


def test_status_counts_the_documents_their_parts_and_the_reduce_levels_to_go(tmp_path, tiny_models, capsys):
    db, job_id = submit(tmp_path, tiny_models("llama"), capsys, "summarize", "--max-chunk-tokens", "40")
    assert main(["status", job_id, "--db", db, "--json"]) == 0
    documents = json.loads(capsys.readouterr().out)["documents"]
    assert (documents["total"], documents["split"], documents["parts_done"]) == (2, 1, 0)
    assert documents["reduce_levels_remaining"] == 2, "the reduces of level 1 and the document's own"
    with JobStore.open(db) as store:  # the full store's path, where the driver's alone cannot answer
        assert store.document_progress(job_id).levels_remaining == 2


def test_an_interrupted_reduce_resumes_to_the_same_results(tmp_path, tiny_models, tokenizer, capsys):
    db, job_id = submit(tmp_path, tiny_models("llama"), capsys, "summarize", "--max-chunk-tokens", "40")
    (tmp_path / "reference").mkdir()
    reference_db, reference_job = submit(tmp_path / "reference", tiny_models("llama"), capsys, "summarize",
                                         "--max-chunk-tokens", "40")
    _, expected, _ = run(reference_db, reference_job, tokenizer, tmp_path / "reference")

    with JobStore.open(db) as store:
        waiting_at_submit = store.job_status(job_id).counts["waiting"]
    assert waiting_at_submit >= 2, "a tree: reduces of level 1 under the document's own"

    def interrupt_in_the_reduce(sent: int, batch) -> None:
        with JobStore.open(db) as store:
            if store.job_status(job_id).counts["waiting"] < waiting_at_submit:  # a level-1 reduce runs
                raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(db, job_id, tokenizer, tmp_path, ParagraphBroker(tokenizer, batch=3, before_deliver=interrupt_in_the_reduce))
    status, rows, _ = run(db, job_id, tokenizer, tmp_path)
    assert status.status == "completed"
    assert {key: row["output"] for key, row in rows.items()} == {key: row["output"] for key, row in expected.items()}


def test_generate_refuses_the_long_document_choices_and_names_them(tmp_path, tiny_models, capsys):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"id": "a", "prompt": "Once"}) + "\n")
    code = main(["submit", str(path), "--task", "generate", "--long-documents", "split", "--model",
                 str(tiny_models("llama")), "--db", f"sqlite:///{tmp_path / 's.db'}"])
    err = capsys.readouterr().err
    assert code != 0
    assert "--long-documents: a generate prompt is sent as it is" in err
    assert "--task summarize" in err and "--long-documents fail" in err


def test_truncate_keeps_one_item_per_document_whose_prompt_holds_only_its_first_piece(tmp_path, tiny_models,
                                                                                      tokenizer, capsys):
    db, job_id = submit(tmp_path, tiny_models("llama"), capsys, "summarize", "--long-documents", "truncate",
                        "--max-chunk-tokens", "40")
    status, rows, items = run(db, job_id, tokenizer, tmp_path)
    assert [item.custom_id for item in items] == ["short", "long"]
    assert "Paragraph 1 opens" in items[1].prompt and "Paragraph 2 opens" not in items[1].prompt
    assert rows["long"]["input"] == numbered(12) and rows["long"]["output"] == "P1"


def test_the_map_and_reduce_prompts_are_templates_the_user_replaces(tmp_path, tiny_models, tokenizer, capsys):
    (tmp_path / "map.txt").write_text("Note the gist of this part:\n{document}")
    (tmp_path / "reduce.txt").write_text("Merge these notes:\n{summaries}")
    db, job_id = submit(tmp_path, tiny_models("llama"), capsys, "summarize", "--max-chunk-tokens", "40",
                        "--map-template", str(tmp_path / "map.txt"), "--reduce-template", str(tmp_path / "reduce.txt"))
    broker = ParagraphBroker(tokenizer, batch=3)
    status, rows, items = run(db, job_id, tokenizer, tmp_path, broker)
    pieces = [item for item in items if item.custom_id.startswith("long#map-")]
    assert pieces and all("Note the gist of this part:" in item.prompt for item in pieces)
    reduces = [tokenizer.decode(r.prompt_ids) for r in broker.requests if "Merge these notes:" in
               tokenizer.decode(r.prompt_ids)]
    assert reduces and "Part 1:\nP1" in reduces[0]
    (tmp_path / "bad.txt").write_text("no marker")
    code = main(["submit", str(tmp_path / "docs.jsonl"), "--task", "summarize", "--reduce-template",
                 str(tmp_path / "bad.txt"), "--model", str(tiny_models("llama")), "--db", db])
    assert code != 0 and "has no {summaries}: write {summaries} in it, to mark the place of the summaries" in \
        capsys.readouterr().err
