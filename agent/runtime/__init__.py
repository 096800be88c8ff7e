"""The model runtime: ModelWorker, one llama.cpp model on one thread (worker.py, with its sampler,
sampling.py, and its stream reader, decoding.py); what any caller of a model sees, whichever process the
model runs in (api.py: settings, completions, errors, TextModel); one way to ask a model with chat
messages and tools (generate.py); an infer task's spec as generate()'s arguments (infer_task.py); and
random-weight GGUF files for tests and benchmarks (testmodel.py).

May import formats (and protocol/); never acting or evaluation.
"""
