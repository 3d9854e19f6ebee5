//! The client of tests/gdn_emulator.cpp's driver, which every emulated family's test runs:
//! a command stream of buffers, launches (grid, block, dynamic shared memory, typed arguments)
//! and dumps, written to a file and run by the emulator binary. Included with
//! `#[path = "emulation/driver.rs"] mod driver;`.

use super::emulation::{read_dumps, splice};
use std::collections::HashMap;
use std::path::Path;
use std::process::Command;

/// tests/gdn_emulator.cpp's `driver` section (`driver`) with its kernel table replaced by
/// `kernels`, the `extern "C"` names of the rendered source the test compiles.
pub fn driver_for(driver: &str, kernels: &[&str]) -> String {
    let entries: String = kernels
        .iter()
        .map(|k| format!("        {{\"{k}\", emu::kernel({k})}},\n"))
        .collect();
    splice(
        driver,
        "    std::map<std::string, std::function",
        "    };",
        &format!(
            "    std::map<std::string, std::function<void(const std::vector<emu::Arg>&)>> \
             kernels = {{\n{entries}    }};\n"
        ),
    )
}

/// A buffer of the command stream (its id).
#[derive(Clone, Copy)]
pub struct Buf(pub u32);

/// A kernel argument.
#[derive(Clone, Copy)]
pub enum Arg {
    Ptr(Buf),
    Null,
    U32(u32),
    F32(f32),
}

/// The command stream.
#[derive(Default)]
pub struct Emu {
    commands: Vec<u8>,
    next: u32,
}

impl Emu {
    pub fn buffer(&mut self, bytes: Vec<u8>) -> Buf {
        self.next += 1;
        self.commands.extend(1u32.to_le_bytes());
        self.commands.extend(self.next.to_le_bytes());
        self.commands.extend((bytes.len() as u64).to_le_bytes());
        self.commands.extend(bytes);
        Buf(self.next)
    }

    pub fn zeros(&mut self, bytes: usize) -> Buf {
        self.buffer(vec![0; bytes])
    }

    /// Overwrites buffer `b` with `bytes` (its length may change).
    #[allow(dead_code)] // not every test that includes the driver uses it
    pub fn refill(&mut self, b: Buf, bytes: Vec<u8>) {
        self.commands.extend(1u32.to_le_bytes());
        self.commands.extend(b.0.to_le_bytes());
        self.commands.extend((bytes.len() as u64).to_le_bytes());
        self.commands.extend(bytes);
    }

    pub fn launch(
        &mut self,
        name: &str,
        grid: (u32, u32),
        threads: u32,
        shared: usize,
        args: &[Arg],
    ) {
        self.launch_clusters(name, grid, 1, threads, shared, args);
    }

    /// A launch whose blocks form clusters of `cluster_y` blocks along grid y (run at once).
    pub fn launch_clusters(
        &mut self,
        name: &str,
        grid: (u32, u32),
        cluster_y: u32,
        threads: u32,
        shared: usize,
        args: &[Arg],
    ) {
        let c = &mut self.commands;
        c.extend(2u32.to_le_bytes());
        c.extend((name.len() as u32).to_le_bytes());
        c.extend(name.as_bytes());
        for v in [
            grid.0,
            grid.1,
            cluster_y,
            threads,
            shared as u32,
            args.len() as u32,
        ] {
            c.extend(v.to_le_bytes());
        }
        for a in args {
            let (kind, value) = match *a {
                Arg::Ptr(b) => (0u32, u64::from(b.0) << 40),
                Arg::Null => (1, 0),
                Arg::U32(v) => (2, u64::from(v)),
                Arg::F32(v) => (3, u64::from(v.to_bits())),
            };
            c.extend(kind.to_le_bytes());
            c.extend(value.to_le_bytes());
        }
    }

    pub fn dump(&mut self, b: Buf) {
        self.commands.extend(3u32.to_le_bytes());
        self.commands.extend(b.0.to_le_bytes());
    }

    /// Runs the commands; returns every dumped buffer by id (the last dump of each).
    pub fn run(&self, exe: &Path, what: &str) -> HashMap<u32, Vec<u8>> {
        self.run_in_order(exe, what).into_iter().collect()
    }

    /// Runs the commands; returns every dump in order (id and bytes), a buffer dumped several
    /// times once per dump.
    pub fn run_in_order(&self, exe: &Path, what: &str) -> Vec<(u32, Vec<u8>)> {
        let dir = exe.parent().expect("emulator folder");
        let (cmd, out) = (
            dir.join(format!("{what}.cmd")),
            dir.join(format!("{what}.out")),
        );
        std::fs::write(&cmd, &self.commands).expect("write commands");
        let mut child = Command::new(exe)
            .arg(&cmd)
            .arg(&out)
            .spawn()
            .expect("start the emulator");
        let started = std::time::Instant::now();
        let status = loop {
            if let Some(status) = child.try_wait().expect("wait") {
                break status;
            }
            if started.elapsed() > std::time::Duration::from_secs(600) {
                let _ = child.kill();
                panic!(
                    "{what}: the emulated kernels ran 10 minutes (a barrier or shuffle not reached by every thread?)"
                );
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        assert!(status.success(), "{what}: the emulator failed ({status})");
        read_dumps(&out)
    }
}
