"""`layerbus serve`: OpenAI's Files and Batch API over the job store, and a dashboard of its jobs, stages and
eval runs, in one ASGI process (FastAPI on uvicorn)."""
