//! The HIP runtime in a build without the `hip` feature: there are no bindings, so opening it
//! fails with the reason and the type has no values (every other method is unreachable, and the
//! compiler knows it). Same signatures as `runtime.rs`.

use super::{DeviceProperties, RawEvent, RawFunction, RawModule, RawStream, Status};
use crate::error::{Error, Result};
use std::ffi::{CStr, c_void};
use std::path::Path;

/// What the HIP backend answers in a build without the `hip` feature.
pub(crate) const NOT_BUILT: &str = "this build has no HIP runtime bindings: rebuild with \
     `--features hip` on a machine with the HIP header (README, Running on Strix Halo)";

/// The header version of the bindings: none in this build.
pub(crate) fn header_version() -> String {
    "none (built without the `hip` feature)".into()
}

/// No values: [`Runtime::load`] always fails.
pub(crate) enum Runtime {}

impl Runtime {
    pub(crate) fn load() -> Result<Self> {
        Err(Error::HipUnavailable(NOT_BUILT.into()))
    }
    pub(crate) fn path(&self) -> &Path {
        match *self {}
    }
    pub(crate) fn version(&self) -> String {
        match *self {}
    }
    pub(crate) fn device_count(&self) -> Result<i32, Status> {
        match *self {}
    }
    pub(crate) fn record_release(&self, _: Result<(), Status>) {
        match *self {}
    }
    pub(crate) fn device_properties(&self, _: i32) -> Result<DeviceProperties, Status> {
        match *self {}
    }
    pub(crate) fn set_device(&self, _: i32) -> Result<(), Status> {
        match *self {}
    }
    pub(crate) fn stream_create(&self) -> Result<RawStream, Status> {
        match *self {}
    }
    pub(crate) unsafe fn stream_destroy(&self, _: RawStream) -> Result<(), Status> {
        match *self {}
    }
    pub(crate) fn stream_synchronize(&self, _: RawStream) -> Result<(), Status> {
        match *self {}
    }
    pub(crate) fn malloc(&self, _: usize) -> Result<u64, Status> {
        match *self {}
    }
    pub(crate) unsafe fn free(&self, _: u64) -> Result<(), Status> {
        match *self {}
    }
    pub(crate) unsafe fn memcpy_htod(
        &self,
        _: u64,
        _: *const u8,
        _: usize,
        _: RawStream,
    ) -> Result<(), Status> {
        match *self {}
    }
    pub(crate) unsafe fn memcpy_dtoh(
        &self,
        _: *mut u8,
        _: u64,
        _: usize,
        _: RawStream,
    ) -> Result<(), Status> {
        match *self {}
    }
    pub(crate) unsafe fn memcpy_dtod(
        &self,
        _: u64,
        _: u64,
        _: usize,
        _: RawStream,
    ) -> Result<(), Status> {
        match *self {}
    }
    pub(crate) unsafe fn memset_zero(&self, _: u64, _: usize, _: RawStream) -> Result<(), Status> {
        match *self {}
    }
    pub(crate) fn module_load(&self, _: &[u8]) -> Result<RawModule, Status> {
        match *self {}
    }
    pub(crate) unsafe fn module_unload(&self, _: RawModule) -> Result<(), Status> {
        match *self {}
    }
    pub(crate) fn module_function(&self, _: RawModule, _: &CStr) -> Result<RawFunction, Status> {
        match *self {}
    }
    pub(crate) unsafe fn launch(
        &self,
        _: RawFunction,
        _: (u32, u32, u32),
        _: (u32, u32, u32),
        _: u32,
        _: RawStream,
        _: &mut [*mut c_void],
    ) -> Result<(), Status> {
        match *self {}
    }
    pub(crate) fn event_create(&self) -> Result<RawEvent, Status> {
        match *self {}
    }
    pub(crate) fn event_record(&self, _: RawEvent, _: RawStream) -> Result<(), Status> {
        match *self {}
    }
    pub(crate) fn event_elapsed_ms(&self, _: RawEvent, _: RawEvent) -> Result<f32, Status> {
        match *self {}
    }
    pub(crate) unsafe fn event_destroy(&self, _: RawEvent) -> Result<(), Status> {
        match *self {}
    }
}
