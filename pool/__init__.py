"""modelpool live system: engines, actors, gateway."""
