"""`python -m layerbus.evals.lm_eval_cli ARGS`: lm-evaluation-harness's own command line, unchanged, with the
"layerbus" model registered first.

lm-eval 0.4.13 finds models only in its registry, filled by its own lm_eval.models and by whatever the
process imported; it scans no entry points, and `--include_path` loads task YAML, not models (a task's
`!function` imports happen after the model is looked up). So `lm_eval --model layerbus` alone says "no
model for this name"; this module does the import, then hands the arguments to lm-eval's CLI:

    python -m layerbus.evals.lm_eval_cli run --model layerbus --model_args pretrained=DIR,stages=2 \\
        --tasks hellaswag --limit 100
"""

from __future__ import annotations


def main() -> None:
    import layerbus.evals.lm_eval_adapter  # noqa: F401  registers "layerbus" (its ImportError says what to install)
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
