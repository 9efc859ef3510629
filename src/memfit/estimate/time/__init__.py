"""The time of one optimizer step.

Owns the modelled step (`costs`: its FLOPs, communication, offload and optimizer terms, and the
step time), the GEMM and attention pricing (`roofline`: each operation of the step at the GPU's
measured GEMM/attention rate or its HBM bandwidth), DeepSpeed's runtime terms fitted on GPU rows
(`runtime_costs`), the step priced from a calibration measured on the machine (`timing`) and
which GPU card a measured device is (`device_match`). May import models/, memory/, trace/ (the
traced step's FLOPs), the estimator's vocabulary and the top-level vocabulary; never the modules
above (core, fit, selection, the CLI).
"""
