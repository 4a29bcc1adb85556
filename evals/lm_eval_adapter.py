"""LayerbusLM: lm-evaluation-harness (0.4.x) runs its own tasks with a layerbus pipeline as the model.

lm-eval does everything it does for its HF backend (task loading, prompts, few-shot, TemplateLM's
_encode_pair and empty-context prefix token, metrics); this class only turns the token ids it is handed
into layerbus job items, runs them on local stage processes, and hands back what HFLM would compute.

Registration: importing this module registers the model under "layerbus" (lm_eval.api.registry). lm-eval
0.4.13 discovers no third-party models by itself (no entry-point scan), so either
    import layerbus.evals.lm_eval_adapter             # then simple_evaluate(model="layerbus", ...)
    simple_evaluate(model=LayerbusLM(pretrained=...))  # or pass an instance
or, for the command line, `python -m layerbus.evals.lm_eval_cli ...` (lm-eval's CLI, after this import).

model_args (--model_args key=value,...):
  pretrained         model directory (default: layerbus's default model, prepared on first use)
  stages             stage processes on this machine (default 1)
  db                 job store URL (default: layerbus's default store under $LAYERBUS_HOME)
  max_length         context length; default as HFLM resolves it (config n_positions / max_position_embeddings /
                     n_ctx, then the tokenizer's model_max_length, then 2048), capped by the model's positions
  max_gen_toks       generation budget when a task gives none (default 256, as HFLM)
  wire               hidden-state codec between stages (default float32; "auto" chooses per link)
  threads_per_stage  torch threads per stage (default 0: the cores shared evenly)
  partition          planned (default), balanced or equal, as `layerbus run --partition`
  device             of the stages, chosen as HFLM chooses: the one given when this machine has it, else cuda:0
                     when there is a GPU, else cpu (lm-eval's CLI passes cuda:0 unless --device says otherwise)
  dtype              of the stages (default float32; HFLM's default is the model's own dtype)
  add_bos_token, prefix_token_id   as HFLM's
  progress           a tqdm bar per job on stderr, on a terminal (default true)
  batch_size, max_batch_size       accepted and ignored: layerbus batches continuously
Every call is one layerbus job named by a digest of the model and its items: an interrupted evaluation
resumes where it stopped, a finished one is re-read without starting a stage (evals/lm_eval_jobs.py).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

try:
    from lm_eval import utils as lm_eval_utils
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.models.utils import (
        handle_stop_sequences,
        has_bos_prefix,
        normalize_gen_kwargs,
        postprocess_generated_text,
        resolve_max_length,
    )
except ImportError as missing:  # the core install leaves lm-eval out: it is an optional extra
    raise ImportError(f"layerbus's lm-eval adapter needs lm-evaluation-harness ({missing}): "
                      "pip install 'layerbus[lm-eval]'") from missing

from layerbus.evals.lm_eval_items import (
    PlannedItem,
    ScoreOutput,
    generation_params,
    plan_loglikelihood,
    plan_rolling,
    read_score_output,
)
from layerbus.evals.lm_eval_jobs import JobOutputs, LocalPipeline, run_items

log = logging.getLogger("layerbus.evals")

MODEL_NAME = "layerbus"
DEFAULT_MAX_GEN_TOKS = 256  # HFLM.max_gen_toks
# lm-eval's fallback when neither config nor tokenizer gives a length (lm_eval.models.utils.DEFAULT_MAX_LENGTH).
DEFAULT_MAX_LENGTH = 2048


@register_model(MODEL_NAME)
class LayerbusLM(TemplateLM):
    """lm-eval's model interface over a layerbus pipeline on this machine (see the module docstring)."""

    def __init__(self, pretrained: str | None = None, stages: int = 1, db: str | None = None,
                 max_length: int | None = None, max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, wire: str = "float32",
                 threads_per_stage: int = 0, partition: str = "planned", device: str | None = None,
                 dtype: str = "float32", add_bos_token: bool | None = None, prefix_token_id: int | None = None,
                 batch_size: int | str | None = None, max_batch_size: int | None = None,
                 progress: bool = True, **unknown: Any) -> None:
        super().__init__()
        if unknown:
            raise TypeError(f"LayerbusLM got unknown model_args {sorted(unknown)}; it takes pretrained, stages, db, "
                            "max_length, max_gen_toks, wire, threads_per_stage, partition, device, dtype, "
                            "add_bos_token, prefix_token_id (batch_size and max_batch_size are ignored)")
        from transformers import AutoTokenizer

        from layerbus.models.fingerprint import model_fingerprint
        from layerbus.models.model_info import read_model_info

        model_dir = _model_dir(pretrained)
        info = read_model_info(model_dir)  # ModelDirError names what is wrong with the directory
        if not 1 <= int(stages) <= info.files.num_layers:
            raise ValueError(f"stages={stages}, but {model_dir} has {info.files.num_layers} layers and every stage "
                             f"needs one: use stages=1 to {info.files.num_layers}")
        self.add_bos_token = None if add_bos_token is None else bool(add_bos_token)
        self.custom_prefix_token_id = None if prefix_token_id is None else int(prefix_token_id)
        tokenizer_kwargs = {} if self.add_bos_token is None else {"add_bos_token": self.add_bos_token}
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir), use_fast=True, **tokenizer_kwargs)
        self._max_length = _max_length(max_length, info.files.config, self.tokenizer, info.max_positions, model_dir)
        self._max_gen_toks = int(max_gen_toks)
        # batch_size / max_batch_size: lm-eval passes them to every model; layerbus batches continuously
        # (slots refill as sequences finish), so there is no batch size to choose.
        self._device = _stage_device(device)
        self.pipeline = LocalPipeline(model_dir=model_dir, stages=int(stages), db=db, max_context=self._max_length,
                                      wire=str(wire), threads_per_stage=int(threads_per_stage),
                                      partition=str(partition), device=self._device, dtype=str(dtype),
                                      progress=bool(progress), model_identity=model_fingerprint(model_dir))
        self.last_job: JobOutputs | None = None  # the job of the latest call: which one, re-read or run

    # --- what TemplateLM and the evaluator read ----------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """HFLM's: the custom one, else BOS, else EOS (evals.encoding.Encoder holds the rule)."""
        from layerbus.evals.encoding import Encoder

        return Encoder(self.tokenizer, custom_prefix_token_id=self.custom_prefix_token_id).prefix_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs: Any) -> list[int]:
        """HFLM.tok_encode: the tokenizer's special-token default unless told, and no second BOS."""
        special: dict[str, bool] = {}
        if add_special_tokens is not None:
            special["add_special_tokens"] = add_special_tokens
        elif self.add_bos_token is not None:
            special["add_special_tokens"] = self.add_bos_token
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False
        encoding = self.tokenizer.encode(string, **special)
        return encoding[-left_truncate_len:] if left_truncate_len else encoding

    def tok_decode(self, tokens: list[int] | int, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """HFLM's (for --apply_chat_template): the tokenizer's chat template as text."""
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=not add_generation_prompt)

    def get_model_info(self) -> dict[str, Any]:
        return {"model_dtype": self.pipeline.dtype, "layerbus_stages": self.pipeline.stages,
                "layerbus_wire": self.pipeline.wire, "model_fingerprint": self.pipeline.model_identity}

    # --- the three request types -------------------------------------------------------------------

    def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str] | None, list[int], list[int]]],
                              disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        """(ll, is_greedy) per request, as HFLM computes them; equal truncated contexts share one item."""
        plan = plan_loglikelihood([(context, continuation) for _, context, continuation in requests],
                                  self.max_length, texts=[key[0] if key else "" for key, _, _ in requests])
        scores = self._scores("loglikelihood", plan.items)
        answers = []
        for (key, _, _), (item, continuation) in zip(requests, plan.answers):
            answer = (scores[item].ll[continuation], scores[item].is_greedy[continuation])
            answers.append(answer)
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return answers

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Each text's ll over HFLM's disjoint rolling windows of max_length tokens (one item per text)."""
        texts = [request.args[0] for request in requests]
        documents = [[lm_eval_utils.make_disjoint_window(window) for window in lm_eval_utils.get_rolling_token_windows(
            token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
            context_len=1)] for text in texts]
        plan = plan_rolling(documents, self.max_length, texts=texts)
        scores = self._scores("loglikelihood_rolling", plan.items)
        results = []
        for text, item in zip(texts, plan.documents):
            total = sum(scores[item].ll) if item is not None else 0.0  # window by window, as HFLM sums
            results.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
        return results

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy generation as HFLM's generate_until: the context left-truncated to max_length - max_gen_toks,
        `until` plus the EOS text as stop strings, the text cut at the first of them."""
        eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        items, stops = [], []
        for context, gen_kwargs in (request.args for request in requests):
            kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            if kwargs.get("do_sample"):
                raise ValueError(f"LayerbusLM generates greedily, but a request asks for sampling ({gen_kwargs}); "
                                 "set do_sample=False (--gen_kwargs do_sample=False,temperature=0)")
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen_toks = kwargs.pop("max_gen_toks")
            max_context = self.max_length - max_gen_toks
            if max_context <= 0:
                raise ValueError(f"max_gen_toks={max_gen_toks} leaves no room for a context in max_length="
                                 f"{self.max_length}: lower max_gen_toks or raise max_length")
            prompt_ids = self._generation_ids(context)[-max_context:]
            items.append(PlannedItem(generation_params(prompt_ids, max_gen_toks, until), context[:200]))
            stops.append(until)
        outputs = self._run("generate_until", items)
        texts = []
        for request, output, until in zip(requests, outputs, stops):
            text = postprocess_generated_text(output, until, None)  # layerbus cut already; lm-eval's cut is the rule
            texts.append(text)
            self.cache_hook.add_partial("generate_until", request.args, text)
        return texts

    # --- running -------------------------------------------------------------------------------------

    def _generation_ids(self, context: str) -> list[int]:
        """HFLM.tok_batch_encode's choice for one string: no special tokens after a BOS text, else add_bos_token,
        else the tokenizer's default. (HFLM decides once per batch from its first string; this is batch size 1.)"""
        if has_bos_prefix(context, getattr(self.tokenizer, "bos_token", None)):
            return self.tokenizer(context, add_special_tokens=False)["input_ids"]
        if self.add_bos_token is not None:
            return self.tokenizer(context, add_special_tokens=self.add_bos_token)["input_ids"]
        return self.tokenizer(context)["input_ids"]

    def _run(self, kind: str, items: list[PlannedItem]) -> tuple[str, ...]:
        self.last_job = run_items(self.pipeline, kind, items)
        return self.last_job.outputs

    def _scores(self, kind: str, items: tuple[PlannedItem, ...]) -> list[ScoreOutput]:
        return [read_score_output(str(index), output) for index, output in enumerate(self._run(kind, list(items)))]


def _model_dir(pretrained: str | None) -> Path:
    if pretrained is None:
        from layerbus.models.default_model import default_model_dir

        return default_model_dir()
    return Path(str(pretrained)).expanduser().absolute()


def _stage_device(device: str | None) -> str:
    """HFLM's choice of device: the one asked for when this machine has it, else CUDA when there is one, else
    the CPU. lm-eval's CLI passes device=cuda:0 unless told otherwise, on machines without a GPU too; a stage
    given a device it cannot use exits, and the broker would wait for it in vain."""
    import torch

    cuda = torch.cuda.is_available()
    if device and not (device.startswith("cuda") and not cuda) and not (device == "mps" and not _has_mps(torch)):
        return device
    if device:
        log.warning("device %s is not available here: the stages run on %s", device, "cuda:0" if cuda else "cpu")
    return "cuda:0" if cuda else "cpu"


def _has_mps(torch: Any) -> bool:
    backend = getattr(torch.backends, "mps", None)
    return bool(backend and backend.is_available())


def _max_length(given: int | None, config: Any, tokenizer: Any, model_limit: int, model_dir: Path) -> int:
    """An explicit max_length (at most the model's positions), else HFLM's resolution capped by the model."""
    if given:
        if int(given) > model_limit:
            raise ValueError(f"max_length={given} is past the {model_limit} positions of {model_dir}: "
                             f"use max_length={model_limit} or less")
        return int(given)
    return min(resolve_max_length(config, tokenizer, default=DEFAULT_MAX_LENGTH), model_limit)
