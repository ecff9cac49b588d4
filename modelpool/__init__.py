"""modelpool: the composition root - CLI and fleet-file loading over scheduler, sims and pool."""
