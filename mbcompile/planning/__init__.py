"""Planning: plan arithmetic (``plan``), system specs (``systems``), the memory and time
model (``cost``, from one fake-tensor ``probe`` per size, the affine ``fit`` of the probes,
and the ``estimates`` it answers with; ``two_phase_cost`` for a two-phase step) and the
choice of the MBS (``explore``: the search; ``exploration``: what it evaluated and chose;
``measure``: real timing when asked; ``bisection``: the one integer bisection they
share). Pure arithmetic and fake-tensor probes: nothing here runs the model for real
unless asked to measure."""
