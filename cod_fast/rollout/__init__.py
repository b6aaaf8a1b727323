"""Rolling out CoD packs: prompts, hints, the chat format, the sampler interface and the driver."""
