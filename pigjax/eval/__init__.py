"""Quality harness: attention policies, real-text data, tasks and the evaluation loop (QUALITY.md,
"Method")."""
