"""Training draft heads (EAGLE-1/2 and EAGLE-3) for a target: the library the training jobs run.

One loop, the head-specific parts beside it; the jobs (`engine.jobs.eagle_data`, `train_eagle`, `train_eagle3`,
`compare_heads`) are thin command lines over these modules, and nothing here imports a job.

- `sample`      the training sample, `TrainError`, default folders, held-out prompts
- `shards`      shard files and the data folder's manifest (write atomically, read back or name the bad file)
- `data`        the target's features over the training corpus: batched prefill, sharded, resumable
                (`make_data`), or computed per batch during training (`featurizer`)
- `loop`        the one training loop: packing, schedule, checkpoints, resume, learning curve (`train_loop`)
- `losses`      the chunked LM-head cross-entropy both heads train with, its reference, top-1 agreement
- `evaluate`    held-out tau by real speculative decoding with the head
- `eagle2`      EAGLE-1/2: batches, loss (feature regression + cross-entropy), `train_eagle`
- `eagle3`      EAGLE-3: `train_eagle3`; `batch3` (draft vocabulary, TTT batches), `ttt` (training-time test
                forward and loss), `eagle3_head` (a new head, the official-layout writer)
- `cards`       the model cards and learning-curve table a run writes
- `compare`     an EAGLE-2 head against an EAGLE-3 head at one tree
"""
