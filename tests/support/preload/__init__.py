"""Launch jobs of several ranks without each rank importing torch and DeepSpeed again.

A rank of the real Megatron-DeepSpeed spends ~6.5 s of CPU importing torch, DeepSpeed and transformers before it does
anything; a DP 4 launch on 2 cores spent two thirds of its wall time there, and the suite launches hundreds. One
server per environment (``server.py``) imports them once, for the whole test session, and forks each job from that
state: an agent per job, which forks the ranks and watches them as torchrun does (``agent.py``); each rank then runs
its script or module exactly as a fresh interpreter would (``rank.py``). The tests start a job with an ordinary
command line (``client.py``, run by ``subprocess``), so a timeout, a kill or the output of a job is handled as any
other process's; ``pool.py`` starts the servers and builds that command line.

Only for the CPU: CUDA must not be initialised before a fork. A server whose imports started a thread refuses to fork
(``pool`` then falls back to the fresh-interpreter launch, saying so once).
"""
