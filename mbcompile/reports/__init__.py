"""What users read: the compile report and validation (``report``) and graph drawings
(``draw``)."""
