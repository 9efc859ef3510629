"""Activations and FLOPs from a traced run of the model's own code on fake CPU tensors.

Owns the tracer (`trace`: the cache and the request API; `trace_step`: one traced training step
under the trainer's own loss code, of the model `trace_model` builds as the trainer does;
`trace_flops`: FLOPs by operation class; `trace_children` and `trace_worker`: tracing in child
processes, the worker module preloaded once by the forkserver) and the bridge to the estimate
(`traced`: the traced activations scaled to a candidate, or why the formulas of
memory/activation_memory answer instead). May import models/, memory/, the estimator's
vocabulary, the top-level vocabulary and the trainer's loss and LoRA code it runs
(`memfit.train.losses`, `memfit.train.lora`); never time/ or the modules above.
"""
