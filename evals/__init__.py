"""Evals: task files and task YAML into documents, lm-evaluation-harness tokenization, metrics, paired comparison, results JSON."""
