"""One file per CPU kernel op, each beside its plain-torch reference: linear, topk, attention, layer,
unispec_tree, window_step. `kernels.cpu` re-exports them; the C functions come from `kernels.cpu.builds`."""
