"""Draft training (`specserve distill`): a standalone small model or an EAGLE head, on the target's samples."""
