"""The save flow: what a hooked ``save_checkpoint`` records, how the job commits it, and what follows it (the
background conversion's trigger). Never imports the resume flow."""
