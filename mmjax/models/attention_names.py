"""The attention implementations by name (no JAX): models/attention.py dispatches on them;
the plan (planner/plan.py) and the settings table (mmjax/settings/) validate them."""

IMPLEMENTATIONS = ("auto", "dense", "chunked", "pallas", "cudnn")
