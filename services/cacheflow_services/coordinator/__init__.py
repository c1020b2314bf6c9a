"""The restore coordinator: admission, batching, prefix lookup, restore and generation through the stage workers."""
