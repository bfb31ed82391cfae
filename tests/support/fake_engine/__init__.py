"""An engine-shaped process tree for the start-up hook's tests (stdlib + xgrammar).

`front` is the process the supervisor starts; it starts a multiprocessing
*spawn* child (as vLLM starts EngineCore and SGLang its schedulers), which
builds an unnamed `ThreadPoolExecutor` in `structured_output` (as
vllm.v1.structured_output's StructuredOutputManager does) and compiles JSON
schema grammars on it with real xgrammar. The test lists this package's
`structured_output` module in `[threads.so_compiler] executors`.
"""
