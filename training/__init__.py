"""Plain PyTorch + Accelerate training code. Imports nothing from Prefect."""
