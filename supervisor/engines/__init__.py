"""What each engine is and how its processes are named (pure, no I/O): the kinds
(vLLM, SGLang, torchrun, Ray) recognised from a command line, their rules that
name an engine-spawned process's rank, the `rank_from` sources and the early
rules the start-up hook applies. Below the config, which validates with them."""
