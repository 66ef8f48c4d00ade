"""The parallelisms, built from scratch, and how a model is wrapped: each way written once.

  strategies                  how a model is wrapped and trained: apply_ddp, apply_fsdp,
                              apply_tp, apply_pp, train_step, the FSDP family's settings
  tensor_parallel_layers      Megatron-LM's tensor parallelism: f and g, the column- and
                              row-parallel linears, the vocabulary-parallel embedding and loss
  pipeline_schedules          the model cut into stages; GPipe and 1F1B, each piece timed
  context_parallel_attention  causal attention over a sequence split across ranks: ring,
                              all-gather and Ulysses
  expert_dispatch             an MoE layer's experts sharded over a group; tokens moved by
                              all-to-all or all-gather
  mesh                        the data x pipeline x context x tensor mesh: coordinates, groups
  sharded_checkpoint          the FSDP model saved with torch.distributed.checkpoint at one
                              world size and resumed at another

Imports torch and the rest of labkit (predict, runtime, model).
"""
