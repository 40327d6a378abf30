//! Pictures of a replay: requested, allocated and reserved bytes over the
//! trace, for each replayed policy, as SVG.
#![forbid(unsafe_code)]

use std::path::Path;

use plotters::prelude::*;

use super::replay::ReplayReport;

const GIB: f64 = (1u64 << 30) as f64;

/// Draws the series of `reports` (one trace, one or two policies) to `path`.
pub fn write_svg(path: &Path, title: &str, reports: &[&ReplayReport]) -> Result<(), String> {
    let draw = || -> Result<(), Box<dyn std::error::Error>> {
        let root = SVGBackend::new(path, (1100, 560)).into_drawing_area();
        root.fill(&WHITE)?;
        let events = reports.iter().flat_map(|r| r.series.last()).map(|s| s.event).max().unwrap_or(1).max(1);
        let top = reports.iter().flat_map(|r| r.series.iter()).map(|s| s.reserved).max().unwrap_or(1) as f64 / GIB;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 22))
            .margin(16)
            .x_label_area_size(44)
            .y_label_area_size(64)
            .build_cartesian_2d(0u64..events, 0f64..(top * 1.08).max(0.001))?;
        chart.configure_mesh().x_desc("event").y_desc("memory (GiB)").draw()?;
        let colours = [(&BLUE, &RED), (&GREEN, &MAGENTA)];
        for (i, report) in reports.iter().enumerate() {
            let (allocated_colour, reserved_colour) = colours[i % colours.len()];
            let policy = report.policy.name();
            if i == 0 {
                chart
                    .draw_series(LineSeries::new(report.series.iter().map(|s| (s.event, s.requested as f64 / GIB)), &BLACK))?
                    .label("requested")
                    .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], BLACK));
            }
            chart
                .draw_series(LineSeries::new(report.series.iter().map(|s| (s.event, s.allocated as f64 / GIB)), allocated_colour))?
                .label(format!("allocated ({policy})"))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], allocated_colour));
            chart
                .draw_series(LineSeries::new(report.series.iter().map(|s| (s.event, s.reserved as f64 / GIB)), reserved_colour))?
                .label(format!("reserved ({policy})"))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], reserved_colour));
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .position(SeriesLabelPosition::LowerRight)
            .draw()?;
        root.present()?;
        Ok(())
    };
    draw().map_err(|e| format!("cannot write {}: {e}", path.display()))
}
