"""The runtime: train state, the compiled-step builder, optimizer, checkpoints, metrics, the run lock,
multi-process start-up and the XLA GPU flags. Above the model, parallel and data layers."""
