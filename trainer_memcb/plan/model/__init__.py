"""The plan's second stage: the model as the Trainer prepares it, on the meta device or fake.

`trainer_model` prepares it as the Trainer does (cache off, checkpointing, train mode);
`step_inputs` makes the batch a collator makes for its head; `quantized` and `lora` add the
bitsandbytes layers and the PEFT adapters; `stand_ins` and `param_shapes` give meta-device
stand-ins their logical shapes; `fake_kernels` and `value_reads` let a fake trace run where the
library's kernels or value reads would need real data.
"""
