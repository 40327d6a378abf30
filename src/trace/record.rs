//! Recording (TIDEPOOL_TRACE): placeholder until the recorder lands.
#![forbid(unsafe_code)]
