"""The resume flow: one ``engine.load_checkpoint`` read, decided, routed, finished (:mod:`.elastic_load` is its
entry). Never imports the save flow."""
