"""The runtime: train state, the compiled-step builder, optimizer, checkpoints and the run lock
(checkpoints/), metrics, evaluation, multi-process start-up. Above the model, parallel and data layers."""
