"""spam, stable_spam, adaclip, ada_norm and StableAdamW against pytorch-optimizer
and torch-optimi."""
