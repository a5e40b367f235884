"""Pipeline stages by layer ranges on torch.distributed (`--split-mode layer`; docs/MULTI_GPU.md).

plan.py     which layers and which device each stage (rank) gets
launch.py   joining the process group: spawning this machine's stages, torchrun, several machines
link.py     rank 0's side: the boundary module in its model, the step's metadata and hidden states out and back
stage.py    another stage's loop: its layers, its KV pool, receive / compute / send
worker.py   `python -m strata.dist.worker`: a stage process spawned by rank 0's machine
"""
