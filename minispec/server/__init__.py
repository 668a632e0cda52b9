"""`minispec serve`: an OpenAI-compatible server over one speculative engine, with Prometheus
metrics and a live page (app.py reads first)."""
