"""Planning: plan arithmetic (``plan``), system specs (``systems``), the memory and time
model (``cost``) and the choice of the MBS (``explore``). Pure arithmetic and fake-tensor
probes: nothing here runs the model for real unless asked to measure."""
