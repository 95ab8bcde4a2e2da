"""mmjax: disaggregated, balanced, modality-parallel training of multimodal LLMs in JAX/XLA.

A regular package (not a namespace one), so an editable install beside another checkout can
never load a module from the other tree. It imports nothing: `import mmjax` stays cheap and
`mmjax.schedule` / `mmjax.planner` stay free of JAX.
"""
__version__ = "0.2.0"
