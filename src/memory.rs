//! The process's memory settings that the gateway's latency depends on.
//!
//! **Transparent huge pages.** mimalloc (the binary's allocator) asks the kernel for huge pages
//! on the memory it maps (`madvise(MADV_HUGEPAGE)`), so with the common THP setting `madvise`
//! the first touch of each new 2 MiB region faults in a whole huge page and zeroes it. On the
//! request path that is a stall: measured with `perf` in `kvgate bench --fleet sim:4`
//! (shared-prefix), 5–12 % of the gateway threads' samples were `clear_page_erms` under
//! `do_huge_pmd_anonymous_page`, and single KV-exact decisions took 4–7 ms of CPU where the
//! rest took under 1 ms (docs/benchmarks.md, "Huge pages on the request path"). The gateway
//! keeps little memory and gains nothing from huge pages, so it turns them off for its process
//! (`prctl(PR_SET_THP_DISABLE)`, what Redis does with `disable-thp yes`); the worker keeps
//! them (its weights and KV cache are large, long-lived buffers where fewer TLB misses pay).

/// Whether this process may use transparent huge pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HugePages {
    /// The kernel's setting applies (and mimalloc's `madvise`).
    Kept,
    /// Off for this process.
    Off,
}

/// Turns transparent huge pages off for this process (every mapping, present and future).
/// An error where the kernel has no such control (not Linux, or older than 3.15); the
/// process then runs as before.
pub fn disable_transparent_huge_pages() -> std::io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: PR_SET_THP_DISABLE takes one integer argument and the rest zero; it changes
        // only this process's memory flags.
        let rc = unsafe { libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) };
        if rc == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        Err(std::io::Error::new(
            std::io::ErrorKind::Unsupported,
            "transparent huge pages are a Linux setting",
        ))
    }
}

/// Applies `choice` for this process and logs what it did; a failure is logged and the
/// process goes on with the kernel's setting. Returns the setting now in effect.
pub fn apply(choice: HugePages) -> HugePages {
    match choice {
        HugePages::Kept => {
            tracing::info!(
                "transparent huge pages kept (the kernel's setting; --transparent-huge-pages)"
            );
            HugePages::Kept
        }
        HugePages::Off => match disable_transparent_huge_pages() {
            Ok(()) => {
                tracing::info!(
                    "transparent huge pages off for this process (--transparent-huge-pages keeps them)"
                );
                HugePages::Off
            }
            Err(e) => {
                tracing::warn!(error = %e, "could not turn transparent huge pages off");
                HugePages::Kept
            }
        },
    }
}

impl HugePages {
    /// From the `--transparent-huge-pages` flag.
    pub fn from_flag(keep: bool) -> HugePages {
        if keep {
            HugePages::Kept
        } else {
            HugePages::Off
        }
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    /// Read back from the kernel: the flag is set on this process after the call. (Run in a
    /// child process would isolate it; setting it in the unit-test process only turns huge
    /// pages off for the tests, which use none.)
    #[test]
    fn the_kernel_reports_huge_pages_off_after_the_call() {
        disable_transparent_huge_pages().expect("prctl");
        // SAFETY: PR_GET_THP_DISABLE takes no arguments and returns the flag.
        let flag = unsafe { libc::prctl(libc::PR_GET_THP_DISABLE, 0, 0, 0, 0) };
        assert_eq!(flag, 1);
    }
}
