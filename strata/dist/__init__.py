"""Pipeline stages by layer ranges on torch.distributed (`--split-mode layer`; docs/MULTI_GPU.md).

plan.py     which layers and which device each stage (rank) gets
launch.py   joining the process group: spawning this machine's stages, torchrun, several machines
link.py     rank 0's side: the boundary module in its model, the steps in flight (their metadata and hidden
            states out, the final hidden states back), the start-up exchanges
stage.py    another stage's loop: its layers, its KV pool, receive / compute / send, its decode graphs
draft.py    the MTP head on the last stage, and rank 0's stand-in for its drafter
worker.py   `python -m strata.dist.worker`: a stage process spawned by rank 0's machine
"""
