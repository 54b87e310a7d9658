"""pdserve's inference engine: paged KV cache, model, kernels, scheduler, sampler, the offline
``LLM`` API and the KV-handover API that prefill/decode disaggregation goes through.

``pdserve.engine.kvcache`` is pure Python (no torch); nothing here imports torch on import.
"""
